"""`runnx generate` and `runnx chat`: text generation from a model folder in the terminal (an Optimum
export, a transformers.js download with its `--variant`, an onnxruntime-genai folder: layouts.py).

    runnx generate MODEL_DIR "The capital of France is" [--chat] [--max-new-tokens N] [--temperature T]
                   [--top-k K] [--top-p P] [--min-p P] [--repetition-penalty R] [--seed S] [--stop TEXT]
    runnx generate MODEL_DIR --input prompts.jsonl --output results.jsonl [--ray [ADDRESS]] [options]
    runnx chat MODEL_DIR [--system TEXT] [sampling options]     (Ctrl-D leaves)

The batch form (one result per prompt, resumable, optionally on Ray) lives in runnx.batch.
"""
from __future__ import annotations

import os
import sys

from runnx.batch.cli import add_batch_arguments, batch_requested


def register(subparsers) -> None:
    generate = subparsers.add_parser("generate", help="generate text from a prompt (streams it, then the speed)",
                                     description="Generate text with a decoder: an Optimum export (model.onnx or "
                                                 "decoder_model_merged.onnx, config.json, generation_config.json, "
                                                 "tokenizer.json), a transformers.js download (onnx/model*.onnx: "
                                                 "--variant) or an onnxruntime-genai folder (genai_config.json).")
    generate.add_argument("model_dir", metavar="MODEL_DIR")
    generate.add_argument("prompt", metavar="PROMPT", nargs="?", help="the prompt (or --input FILE)")
    generate.add_argument("--chat", action="store_true",
                          help="wrap the prompt as a user message in the tokenizer's chat template")
    generate.add_argument("--system", help="system message (with --chat)")
    _add_decoding_arguments(generate)
    generate.add_argument("--profile", action="store_true", help="print runnx's per-op profile afterwards")
    add_batch_arguments(generate, "--input", 'prompts, one JSON object per line: {"id": ..., "prompt": ...} '
                                             'or {"id": ..., "messages": [...]}, with optional decoding settings')
    generate.set_defaults(func=command_generate, compile_key=_compile_key, compile_argv=_compile_argv)

    chat = subparsers.add_parser("chat", help="interactive multi-turn chat (Ctrl-D to leave)",
                                 description="Chat with an instruction-tuned decoder; earlier turns stay in the "
                                             "KV cache, so each turn runs only its new tokens.")
    chat.add_argument("model_dir", metavar="MODEL_DIR")
    chat.add_argument("--system", help="system message")
    _add_decoding_arguments(chat)
    chat.set_defaults(func=command_chat, compile_key=_compile_key, compile_argv=_compile_argv)


def _add_decoding_arguments(parser) -> None:
    parser.add_argument("--variant", metavar="NAME",
                        help="which onnx/model_*.onnx of a transformers.js folder: fp32 (model.onnx, the default), "
                             "fp16, int8 (model_int8 or model_quantized), q4, q4f16, ... (the file's suffix)")
    parser.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="default 256")
    parser.add_argument("--temperature", type=float, metavar="T", help="sample with this temperature")
    parser.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens")
    parser.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling")
    parser.add_argument("--min-p", type=float, metavar="P", help="drop tokens below P times the best one")
    parser.add_argument("--repetition-penalty", type=float, metavar="R")
    parser.add_argument("--seed", type=int, metavar="S", help="seed of sampling (reproducible)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop string (repeatable); the output ends right before it")


_COMPILING_TOKENS = 8  # a generation that compiles the kernels (`runnx/background_compile.py`): prompt and steps


def _compile_key(args) -> list:
    """What chooses the kernels a generation calls: the model, and whether a chat template wraps it."""
    return ["generate", os.path.abspath(args.model_dir), bool(getattr(args, "chat", True)), args.variant]


def _compile_argv(args) -> list[str] | None:
    """The generation that compiles them: this prompt (chat: a short one), a few tokens (a batch
    job compiles on first use)."""
    if getattr(args, "batch_input", None) is not None:
        return None
    prompt = getattr(args, "prompt", None) or "Hello"
    chat = getattr(args, "chat", True)
    system = ["--system", args.system] if args.system else []
    variant = ["--variant", args.variant] if args.variant else []
    return ["generate", args.model_dir, prompt, *variant, *(["--chat", *system] if chat else []), "--max-new-tokens",
            str(min(args.max_new_tokens, _COMPILING_TOKENS))]


def _settings(args) -> dict:
    return {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
            "top_p": args.top_p, "min_p": args.min_p, "repetition_penalty": args.repetition_penalty,
            "seed": args.seed, "stop_strings": tuple(args.stop)}


def _load(model_dir, profile=None, variant=None):
    # imported here, not at module level: `runnx` imports every plug-in at start-up
    from runnx.generate.generator import Generator
    return Generator.from_folder(model_dir, profile=profile, variant=variant)


def command_generate(args) -> int:
    import runnx
    if batch_requested(args, args.prompt is not None, "--input"):
        from runnx.batch.cli import run_generate_batch
        return run_generate_batch(args, _settings(args))
    profile = runnx.Profile() if args.profile else None
    generator = _load(args.model_dir, profile, args.variant)
    if args.chat:
        from runnx.generate.chat import Chat
        pieces = Chat(generator, system=args.system).send(args.prompt, **_settings(args))
    else:
        pieces = generator.stream(args.prompt, **_settings(args))
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(describe_stats(generator.stats), file=sys.stderr)
    if profile is not None:
        print(profile.summary(), file=sys.stderr)
    return 0


def describe_stats(stats) -> str:
    return (f"prompt: {stats.prompt_tokens} tokens, {stats.prompt_tokens_per_second:.1f} tokens/s | "
            f"generation: {stats.new_tokens} tokens, {stats.decode_tokens_per_second:.1f} tokens/s | "
            f"time to first token: {stats.first_token_seconds:.2f} s")


def command_chat(args) -> int:
    from runnx.generate.chat import Chat
    chat = Chat(_load(args.model_dir, variant=args.variant), system=args.system, **_settings(args))
    print("runnx chat: type a message; Ctrl-D leaves.", file=sys.stderr)
    while True:
        try:
            text = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not text.strip():
            continue
        for piece in chat.send(text):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        print(describe_stats(chat.generator.stats), file=sys.stderr)
