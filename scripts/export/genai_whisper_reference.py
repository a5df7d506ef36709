"""Record onnxruntime-genai's own greedy transcription on an onnxruntime-genai Whisper folder, so that
runnx's tests compare against it without importing onnxruntime-genai (it lives in the genai venv only):

    python genai_whisper_reference.py MODEL_DIR AUDIO_DIR OUT.json --clips john.wav fox.wav weather.wav

Each clip (16 kHz mono WAV, at most 30 s) goes through the folder's audio processor with the decoder
prompt PROMPT and is decoded greedily (one thread per session) until an eos token or MAX_LENGTH;
OUT.json holds, per clip, the whole sequence as onnxruntime-genai returns it (prompt ids first) and
its decoded text.
"""
import argparse
import json
import os

import onnxruntime_genai as og

PROMPT = "<|startoftranscript|><|notimestamps|>"
MAX_LENGTH = 448  # Whisper's max_target_positions


def transcribe(model, processor, wav: str) -> dict:
    inputs = processor([PROMPT], audios=og.Audios.open(wav))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=MAX_LENGTH, batch_size=1)
    generator = og.Generator(model, params)
    generator.set_inputs(inputs)
    while not generator.is_done():
        generator.generate_next_token()
    tokens = [int(t) for t in generator.get_sequence(0)]
    return {"tokens": tokens, "text": processor.decode(tokens)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("audio_dir")
    parser.add_argument("out")
    parser.add_argument("--clips", nargs="+", required=True, help="file names in AUDIO_DIR")
    args = parser.parse_args()
    config = og.Config(args.model_dir)
    one_thread = {"session_options": {"intra_op_num_threads": 1}}
    config.overlay(json.dumps({"model": {"encoder": one_thread, "decoder": one_thread}}))
    model = og.Model(config)
    processor = model.create_multimodal_processor()
    clips = {name: transcribe(model, processor, os.path.join(args.audio_dir, name)) for name in args.clips}
    record = {"onnxruntime_genai": og.__version__, "prompt": PROMPT, "max_length": MAX_LENGTH, "clips": clips}
    with open(args.out, "w") as file:
        json.dump(record, file, indent=1)
        file.write("\n")


if __name__ == "__main__":
    main()
