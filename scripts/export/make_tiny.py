"""Create the tiny random-weight Hugging Face models behind runnx's committed test fixtures.

    python make_tiny.py OUT_DIR        -> OUT_DIR/{tiny-llama, tiny-gpt2, tiny-whisper}

Deterministic (torch seed 0, tokenizers trained on tiny_corpus.txt): same files on every run.
Every model has a vocabulary of 1000 and a real byte-level BPE tokenizer of exactly that size, so
the generation and Whisper pipelines can be tested end to end on them (with random weights the
text is gibberish, but every step runs). Runs in the export venv.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (GenerationConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast, WhisperConfig, WhisperFeatureExtractor,
                          WhisperForConditionalGeneration, WhisperProcessor, WhisperTokenizerFast)

VOCAB_SIZE = 1000
CORPUS = Path(__file__).with_name("tiny_corpus.txt")
# Text-model special tokens, SmolLM2's layout: ids 0, 1, 2.
TEXT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PAD, BOS, EOS = 0, 1, 2
# Whisper's English-only layout: <|endoftext|> inside the BPE vocabulary, the task tokens after it.
WHISPER_SPECIALS = ["<|startoftranscript|>", "<|en|>", "<|translate|>", "<|transcribe|>", "<|startoflm|>",
                    "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def train_bpe(vocab_size: int, special_tokens: list[str]) -> Tokenizer:
    """A GPT-2-style byte-level BPE trained on the corpus to exactly `vocab_size` tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS.read_text().splitlines(), trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"the corpus gave {tokenizer.get_vocab_size()} tokens, not {vocab_size}: add text")
    return tokenizer


def text_tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=train_bpe(VOCAB_SIZE, TEXT_SPECIALS), bos_token=TEXT_SPECIALS[BOS],
                                   eos_token=TEXT_SPECIALS[EOS], pad_token=TEXT_SPECIALS[PAD],
                                   unk_token=TEXT_SPECIALS[PAD], model_max_length=256, chat_template=CHAT_TEMPLATE)


def save(model, tokenizer, generation: GenerationConfig, out_dir: Path) -> None:
    model.eval()
    model.generation_config = generation
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)


def make_llama(out_dir: Path) -> None:
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False)
    generation = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    save(LlamaForCausalLM(config), text_tokenizer(), generation, out_dir)


def make_gpt2(out_dir: Path) -> None:
    config = GPT2Config(vocab_size=VOCAB_SIZE, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                        bos_token_id=BOS, eos_token_id=EOS)
    generation = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    save(GPT2LMHeadModel(config), text_tokenizer(), generation, out_dir)


def make_whisper(out_dir: Path) -> None:
    bpe_size = VOCAB_SIZE - len(WHISPER_SPECIALS)
    bpe = train_bpe(bpe_size, ["<|endoftext|>"])
    bpe.add_special_tokens(WHISPER_SPECIALS)
    end_of_text = 0
    start_of_transcript, no_timestamps = bpe_size, VOCAB_SIZE - 1
    begin_suppress = [bpe.token_to_id("\u0120"), end_of_text]  # a lone space or the end, as Whisper's [220, 50256]
    config = WhisperConfig(vocab_size=VOCAB_SIZE, num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                           decoder_ffn_dim=128, max_source_positions=1500, max_target_positions=448,
                           bos_token_id=start_of_transcript, eos_token_id=end_of_text, pad_token_id=end_of_text,
                           decoder_start_token_id=start_of_transcript, suppress_tokens=[],
                           begin_suppress_tokens=begin_suppress)
    # The same generation settings as Whisper tiny.en's (English-only: no language or task token).
    generation = GenerationConfig(
        decoder_start_token_id=start_of_transcript, bos_token_id=start_of_transcript, eos_token_id=end_of_text,
        pad_token_id=end_of_text, max_length=448, suppress_tokens=[], begin_suppress_tokens=begin_suppress,
        is_multilingual=False, no_timestamps_token_id=no_timestamps,
        prev_sot_token_id=bpe.token_to_id("<|startofprev|>"), return_timestamps=False,
        forced_decoder_ids=[[1, no_timestamps]])
    bpe_file = out_dir / "bpe.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    bpe.save(str(bpe_file))
    special = "<|endoftext|>"
    tokenizer = WhisperTokenizerFast(tokenizer_file=str(bpe_file), bos_token=special, eos_token=special,
                                     unk_token=special, pad_token=special, model_max_length=448)
    bpe_file.unlink()
    features = WhisperFeatureExtractor(feature_size=80, sampling_rate=16000, hop_length=160, chunk_length=30,
                                       n_fft=400)
    model = WhisperForConditionalGeneration(config).eval()
    model.generation_config = generation
    model.save_pretrained(out_dir)
    WhisperProcessor(feature_extractor=features, tokenizer=tokenizer).save_pretrained(out_dir)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_tiny.py OUT_DIR")
    out = Path(sys.argv[1])
    for name, make in (("tiny-llama", make_llama), ("tiny-gpt2", make_gpt2), ("tiny-whisper", make_whisper)):
        torch.manual_seed(0)  # each model's weights depend on nothing but the seed and its own config
        make(out / name)
        print(name, sorted(p.name for p in (out / name).iterdir()))
