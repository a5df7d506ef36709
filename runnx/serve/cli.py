"""`runnx serve MODEL_DIR [MODEL_DIR ...] [--host 127.0.0.1] [--port 8000] [--api-key KEY]`:
an OpenAI-compatible HTTP server (uvicorn) for language models and Whisper models."""
from __future__ import annotations

import os

from runnx.errors import RunnxError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve models over an OpenAI-compatible HTTP API (chat, completions, transcriptions)",
        description="Serve language models (Optimum exports, transformers.js folders, onnxruntime-genai folders, "
                    "each with tokenizer.json) and Whisper exports "
                    "over OpenAI's API: /v1/chat/completions, /v1/completions, /v1/audio/transcriptions, "
                    "/v1/models, /health. A model's id is its folder name. Concurrent requests to one "
                    "language model share its decode steps (continuous batching).")
    parser.add_argument("model_dirs", metavar="MODEL_DIR", nargs="+", help="model folder(s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--api-key", default=os.environ.get("RUNNX_API_KEY"), metavar="KEY",
                        help="require 'Authorization: Bearer KEY' (default: $RUNNX_API_KEY, else no key)")
    parser.add_argument("--max-batch", type=int, default=16, metavar="N",
                        help="most requests decoded together per model (default 16; more wait their turn)")
    parser.add_argument("--variant", metavar="NAME",
                        help="the onnx/ file of transformers.js folders: fp32 (default), fp16, int8, q4, ... "
                             "(other folders hold one model and ignore it)")
    parser.add_argument("--max-body-mb", type=float, default=25.0, metavar="MB",
                        help="largest request body, an audio upload included (default 25)")
    parser.set_defaults(func=command_serve)


def command_serve(args) -> int:
    try:
        import uvicorn
    except ImportError:
        raise RunnxError("runnx serve needs the 'serve' extra: pip install 'runnx[serve]'") from None
    if args.max_batch < 1:
        raise RunnxError("--max-batch must be at least 1")
    from runnx.serve.app import create_app
    from runnx.serve.models import load_models
    models = load_models(args.model_dirs, max_batch=args.max_batch, variant=args.variant)
    for model in models.values():
        batch = "" if model.kind == "audio" or model.max_batch == args.max_batch else (
            f", {model.max_batch} request at a time: its attention cannot take left-padded rows")
        print(f"runnx serve: {model.id} ({'Whisper' if model.kind == 'audio' else 'language model'}) "
              f"from {model.folder}{batch}")
    app = create_app(models, api_key=args.api_key, max_body_bytes=int(args.max_body_mb * 1024 * 1024))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
