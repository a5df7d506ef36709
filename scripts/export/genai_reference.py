"""Record onnxruntime-genai's own greedy generation on an onnxruntime-genai folder, so that runnx's
tests compare against it without importing onnxruntime-genai (it lives in the genai venv only):

    python genai_reference.py MODEL_DIR OUT.json --prompts PROMPTS.json --max-new-tokens 24

PROMPTS.json is a list of user messages. Each is rendered with the folder's chat template by
onnxruntime-genai's tokenizer, encoded, and decoded greedily (one thread) until an eos token or
the token budget; OUT.json holds, per prompt, the rendered text, the prompt ids and the new ids.
"""
import argparse
import json

import onnxruntime_genai as og


def greedy(model, tokenizer, message: str, max_new_tokens: int) -> dict:
    text = tokenizer.apply_chat_template(json.dumps([{"role": "user", "content": message}]),
                                         add_generation_prompt=True)
    prompt_ids = [int(i) for i in tokenizer.encode(text)]
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt_ids) + max_new_tokens)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt_ids)
    new_ids = []
    while not generator.is_done():
        generator.generate_next_token()
        new_ids.append(int(generator.get_next_tokens()[0]))
    return {"message": message, "text": text, "prompt_ids": prompt_ids, "new_ids": new_ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()
    config = og.Config(args.model_dir)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": 1}}}}))
    model = og.Model(config)
    tokenizer = og.Tokenizer(model)
    with open(args.prompts) as file:
        messages = json.load(file)
    runs = [greedy(model, tokenizer, message, args.max_new_tokens) for message in messages]
    record = {"onnxruntime_genai": og.__version__, "max_new_tokens": args.max_new_tokens,
              "eos_token_ids": [int(i) for i in tokenizer.eos_token_ids], "runs": runs}
    with open(args.out, "w") as file:
        json.dump(record, file, indent=1)
        file.write("\n")


if __name__ == "__main__":
    main()
