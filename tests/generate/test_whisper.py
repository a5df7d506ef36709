"""The Whisper pipeline: special tokens and prompts, Whisper's logits rules, long-audio segmentation,
output formats; decoded token ids against onnxruntime on the tiny random fixture and the real
tiny.en; transcripts of eSpeak NG clips and of a recorded human reader (tests/fixtures/human_speech)."""
from __future__ import annotations

import argparse
import json
import shutil

import numpy as np
import pytest

from runnx import Profile
from runnx.capture import spare_capacity
from runnx.generate import mel
from runnx.generate.audio import load_audio
from runnx.generate.whisper import (
    SuppressAtBegin, SuppressTokens, TimestampRules, Whisper, WhisperError, WhisperTokens, split_segments,
    transcribe,
)
from runnx.generate.whisper_cli import clock, register, render

# tiny.en's layout: <|endoftext|> 50256, <|startoftranscript|> 50257, <|notimestamps|> 50362, <|0.00|> 50363
EOT, SOT, NO_TS, TS0 = 50256, 50257, 50362, 50363
TINY_EN_CONFIG = {"vocab_size": 51864, "decoder_start_token_id": SOT, "eos_token_id": EOT}
TINY_EN_GENERATION = {"decoder_start_token_id": SOT, "eos_token_id": EOT, "no_timestamps_token_id": NO_TS,
                      "is_multilingual": False, "suppress_tokens": [1, 2, 50357], "begin_suppress_tokens": [220, EOT],
                      "max_initial_timestamp_index": 50}
MULTILINGUAL_SPECIAL = {"<|endoftext|>": 50257, "<|startoftranscript|>": 50258, "<|en|>": 50259, "<|de|>": 50261,
                        "<|translate|>": 50358, "<|transcribe|>": 50359, "<|notimestamps|>": 50363,
                        "<|nocaptions|>": 50362}


def _rules(max_initial=50, begin=1):
    return TimestampRules(TS0, EOT, SOT, NO_TS, begin_index=begin, max_initial_index=max_initial)


def _apply(rule, generated, scores=None, prompt=(SOT,)):
    ids = np.array([list(prompt) + list(generated)], np.int64)
    if scores is None:  # every token allowed; timestamps unlikely, so that their sum does not win
        scores = np.zeros((1, 51864), np.float32)
        scores[0, TS0:] = -20.0
    return rule(ids, scores)[0]


# -- special tokens and prompts ---------------------------------------------------------------------
def test_english_only_tokens_and_prompts():
    tokens = WhisperTokens.from_configs(TINY_EN_CONFIG, TINY_EN_GENERATION, {})
    assert not tokens.multilingual and tokens.timestamp_begin == TS0 and tokens.text_end == SOT
    assert tokens.is_text(EOT - 1) and not tokens.is_text(EOT) and not tokens.is_text(TS0)
    assert tokens.prompt(None, "transcribe", timestamps=False) == [SOT, NO_TS]
    assert tokens.prompt("de", "translate", timestamps=True) == [SOT]  # English-only: no language/task tokens
    assert tokens.suppress_at_begin == (220, EOT)


def test_multilingual_tokens_from_the_tokenizer_and_prompts():
    config = {"vocab_size": 51865, "decoder_start_token_id": 50258, "eos_token_id": 50257}
    tokens = WhisperTokens.from_configs(config, {}, MULTILINGUAL_SPECIAL)
    assert tokens.multilingual  # 51865 tokens: openai-whisper's rule
    assert tokens.languages == {"en": 50259, "de": 50261}
    assert tokens.tasks == {"translate": 50358, "transcribe": 50359}
    assert tokens.prompt("de", "transcribe", timestamps=False) == [50258, 50261, 50359, 50363]
    assert tokens.prompt("<|en|>", "translate", timestamps=True) == [50258, 50259, 50358]
    assert tokens.prompt(None, "transcribe", timestamps=True) == [50258]  # language still to detect
    with pytest.raises(WhisperError, match="unknown language 'xx'.*de, en"):
        tokens.prompt("xx", "transcribe", False)
    with pytest.raises(WhisperError, match="unknown task"):
        tokens.prompt("en", "summarise", False)


def test_generation_config_wins_over_the_tokenizer():
    generation = {"lang_to_id": {"<|fr|>": 7}, "task_to_id": {"transcribe": 8}, "is_multilingual": True,
                  "decoder_start_token_id": 1, "eos_token_id": 2}
    tokens = WhisperTokens.from_configs({}, generation, MULTILINGUAL_SPECIAL)
    assert tokens.languages == {"fr": 7} and tokens.tasks == {"transcribe": 8}
    assert tokens.prompt("fr", "transcribe", True) == [1, 7, 8]


# -- logits rules ---------------------------------------------------------------------------------
def test_suppress_tokens_and_suppress_at_begin():
    scores = np.zeros((1, 10), np.float32)
    assert np.isneginf(SuppressTokens((3, 4))(np.array([[0]]), scores)[0, [3, 4]]).all()
    assert (scores == 0).all()  # processors do not write their input
    begin = SuppressAtBegin((5,), begin_index=2)
    assert np.isneginf(begin(np.array([[0, 1]]), scores)[0, 5])
    assert begin(np.array([[0, 1, 2]]), scores)[0, 5] == 0  # only the first generated token


def test_first_token_is_an_early_timestamp():
    allowed = np.isfinite(_apply(_rules(max_initial=50), []))
    assert not allowed[:TS0].any()
    assert allowed[TS0:TS0 + 51].all() and not allowed[TS0 + 51:].any()
    assert not allowed[NO_TS]


def test_timestamp_grammar():
    text = 400
    after_open = np.isfinite(_apply(_rules(), [TS0 + 5]))
    assert not after_open[TS0:].any() and after_open[text]  # an opening timestamp is followed by text
    after_text = np.isfinite(_apply(_rules(), [TS0 + 5, text]))
    assert after_text[text] and after_text[EOT]
    assert not after_text[TS0:TS0 + 6].any() and after_text[TS0 + 6]  # the closing one comes later
    after_close = np.isfinite(_apply(_rules(), [TS0 + 5, text, TS0 + 9]))
    assert not after_close[:EOT].any()  # a text token cannot follow where a timestamp must
    assert after_close[EOT] and after_close[TS0 + 9] and not after_close[TS0 + 8]  # never decreasing
    after_pair = np.isfinite(_apply(_rules(), [TS0 + 5, text, TS0 + 9, TS0 + 9]))
    assert not after_pair[TS0:].any() and after_pair[text]  # no third timestamp in a row


def test_timestamps_win_when_together_more_likely_than_any_text_token():
    scores = np.full((1, 51864), -10.0, np.float32)
    scores[0, 400] = 2.0  # the best single token is text ...
    scores[0, TS0 + 10:TS0 + 40] = 0.0  # ... but 30 timestamps together outweigh it
    allowed = np.isfinite(_apply(_rules(), [TS0, 300], scores))
    assert not allowed[:TS0].any() and allowed[TS0 + 10]


@pytest.mark.parametrize("seed", range(5))
def test_greedy_choice_under_the_rules_keeps_the_grammar(seed):
    rng = np.random.default_rng(seed)
    rule, generated = _rules(), []
    for _ in range(120):
        scores = rng.normal(size=(1, 51864)).astype(np.float32)
        scores[0, TS0:] += rng.normal(2.0, 1.0)  # make timestamps competitive
        scores[0, EOT + 1:TS0] = -np.inf  # the other special tokens are suppressed by SuppressTokens
        token = int(_apply(rule, generated, scores).argmax())
        if token == EOT:
            break
        generated.append(token)
    stamps = [t for t in generated if t >= TS0]
    assert generated[0] >= TS0 and stamps == sorted(stamps)
    kinds = "".join("t" if t >= TS0 else "x" for t in generated)
    assert "ttt" not in kinds and not kinds.startswith("tt")
    for i in range(2, len(kinds)):  # after text-then-timestamp only a timestamp (or the end) follows
        if kinds[i - 2:i] == "xt":
            assert kinds[i] == "t"


# -- long audio: segments and seeking -------------------------------------------------------------
def test_segments_of_complete_pairs_and_seek_to_the_last_closing_timestamp():
    tokens = [TS0, 10, 11, TS0 + 150, TS0 + 150, 12, TS0 + 400, TS0 + 410, 13]  # the last pair is unfinished
    segments, seek = split_segments(tokens, TS0, 3000)
    assert [(start, end) for start, end, _ in segments] == [(0, 300), (300, 800)]
    assert segments[1][2] == [TS0 + 150, 12, TS0 + 400]
    assert seek == 800  # the next window re-decodes from the unfinished segment


def test_single_timestamp_ending_consumes_the_window():
    tokens = [TS0, 10, TS0 + 100, TS0 + 100, 11, TS0 + 500]
    segments, seek = split_segments(tokens, TS0, 2400)
    assert [(start, end) for start, end, _ in segments] == [(0, 200), (200, 1000)]
    assert seek == 2400


def test_window_without_pairs_is_one_segment():
    segments, seek = split_segments([TS0, 10, 11, TS0 + 250], TS0, 3000)
    assert segments == [(0, 500, [TS0, 10, 11, TS0 + 250])] and seek == 3000
    segments, seek = split_segments([10, 11], None, 1234)  # no-timestamp mode: the whole window
    assert segments == [(0, 1234, [10, 11])] and seek == 1234


# -- output formats -------------------------------------------------------------------------------
def test_clock_and_subtitle_formats():
    from runnx.generate.whisper import Segment, Transcript
    assert clock(3725.5, ",") == "01:02:05,500" and clock(5.25, hours=False) == "00:05.250"
    transcript = Transcript("Hi there. Bye.", [Segment(0.0, 1.5, "Hi there.", (1,)), Segment(1.5, 3.02, "Bye.", (2,))],
                            "en")
    assert render(transcript, "txt") == "Hi there. Bye.\n"
    assert render(transcript, "txt", timestamps=True).splitlines()[1] == "[00:01.500 --> 00:03.020]  Bye."
    assert render(transcript, "srt") == ("1\n00:00:00,000 --> 00:00:01,500\nHi there.\n\n"
                                         "2\n00:00:01,500 --> 00:00:03,020\nBye.\n\n")
    assert render(transcript, "vtt").startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHi there.\n")
    document = json.loads(render(transcript, "json", source="a.wav"))
    assert document["file"] == "a.wav" and document["segments"][1] == {"start": 1.5, "end": 3.02, "text": "Bye."}


# -- the tiny random fixture against onnxruntime --------------------------------------------------
@pytest.fixture(scope="module")
def tiny_whisper(fixtures_dir):
    return fixtures_dir / "tiny-whisper"  # committed: a missing file is a failure, not a skip


@pytest.fixture(scope="module")
def clip_features(fixtures_dir):
    return mel.window_features(load_audio(fixtures_dir / "whisper_features" / "clip.wav"))


def _variant(tmp_path, folder, generation: dict, files=("encoder_model.onnx", "decoder_model_merged.onnx",
                                                         "config.json")):
    """The tiny model's ONNX files with another generation_config.json (special token layout)."""
    for name in files:
        shutil.copy(folder / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


# The tiny model pretending to be multilingual with timestamps: 998 start, 500 end of text, languages
# 501-503, tasks 510/511, 600 no-timestamps, 601-999 timestamps (0.00 to 7.96 s)
MULTILINGUAL_TINY = {"decoder_start_token_id": 998, "eos_token_id": 500, "is_multilingual": True,
                     "lang_to_id": {"<|en|>": 501, "<|de|>": 502, "<|fr|>": 503},
                     "task_to_id": {"translate": 510, "transcribe": 511}, "no_timestamps_token_id": 600,
                     "suppress_tokens": [998, 510, 511], "begin_suppress_tokens": [500],
                     "max_initial_timestamp_index": 50}


@pytest.fixture(scope="module")
def multilingual_tiny(tiny_whisper, tmp_path_factory):
    return _variant(tmp_path_factory.mktemp("multilingual"), tiny_whisper, MULTILINGUAL_TINY,
                    ("encoder_model.onnx", "decoder_model_merged.onnx", "config.json", "tokenizer.json"))


def test_tiny_token_ids_equal_onnxruntime(tiny_whisper, clip_features):
    from _ort_whisper import OrtGreedy
    model = Whisper(tiny_whisper)
    hidden = model.encode(clip_features)
    model.decoder.profile = profile = Profile()
    decoded = model.decode(hidden, max_new_tokens=40)
    tokens = model.tokens
    assert tokens.prompt(None, "transcribe", False) == [992, 999]  # tiny.en's layout, in 1000 tokens
    expected = OrtGreedy(tiny_whisper)(clip_features, [992, 999], eos=tokens.end_of_text, suppress=tokens.suppress,
                                       begin_suppress=tokens.suppress_at_begin, max_new_tokens=40)
    assert decoded.tokens == expected and len(expected) > 0
    # the self-attention KV grew in place in its 448-row buffers: every step after the first appended
    # each layer's key and value into spare capacity
    layers = model.decoder.past_io.num_layers
    assert profile.runs > 1 and profile.counters["Concat.appends_in_place"] == (profile.runs - 1) * 2 * layers
    cache = model.decoder.cache
    assert cache.regrowths == 0
    assert all(a.shape[2] + spare_capacity(a, 2) == 448 for a in cache.arrays.values())


def test_tiny_multilingual_detection_and_timestamps_equal_onnxruntime(multilingual_tiny, clip_features):
    from _ort_whisper import OrtModel
    ours, reference = Whisper(multilingual_tiny), Whisper(multilingual_tiny, load=OrtModel)
    hidden = ours.encode(clip_features)
    np.testing.assert_allclose(hidden, reference.encode(clip_features), atol=1e-4)
    first = reference.decoder
    first.reset(fixed_feeds={"encoder_hidden_states": hidden})
    logits = first.step(np.array([[998]]))[0, -1]
    expected_language = ["en", "de", "fr"][int(logits[[501, 502, 503]].argmax())]
    assert ours.detect_language(hidden) == expected_language
    for timestamps in (False, True):
        decoded = ours.decode(hidden, timestamps=timestamps, max_new_tokens=60)
        assert decoded.language == expected_language
        assert decoded.tokens == reference.decode(hidden, timestamps=timestamps, max_new_tokens=60).tokens
    assert 500 not in decoded.tokens and 600 not in decoded.tokens  # timestamp mode: <|notimestamps|> suppressed
    stamps = [t for t in decoded.tokens if t >= 601]
    assert decoded.tokens[0] >= 601 and stamps == sorted(stamps)
    assert ours.decode(hidden, language="fr", max_new_tokens=5).language == "fr"


def test_tiny_multilingual_long_audio_equals_onnxruntime(multilingual_tiny, fixtures_dir):
    from _ort_whisper import OrtModel
    clip = load_audio(fixtures_dir / "whisper_features" / "clip.wav")
    audio = np.tile(clip, 14)  # 39 s: two windows at least; the 8 s of timestamps make it more
    ours = Whisper(multilingual_tiny).transcribe(audio, task="translate", max_new_tokens=60)
    reference = Whisper(multilingual_tiny, load=OrtModel).transcribe(audio, task="translate", max_new_tokens=60)
    assert ours.timings.windows > 2 and ours.language in ("en", "de", "fr")
    assert [s.tokens for s in ours.segments] == [s.tokens for s in reference.segments]
    assert (ours.text, ours.language) == (reference.text, reference.language)
    times = [t for s in ours.segments for t in (s.start, s.end)]
    assert times == sorted(times) and times[-1] <= ours.timings.audio and len(ours.segments) > 2


def test_tiny_transcript_end_to_end(tiny_whisper, fixtures_dir):
    model = Whisper(tiny_whisper)
    transcript = transcribe(fixtures_dir / "whisper_features" / "clip.wav", model)
    decoded = model.decode(model.encode(mel.window_features(load_audio(fixtures_dir / "whisper_features" / "clip.wav"))))
    text_tokens = [t for t in decoded.tokens if 0 < t < 992]  # <|endoftext|> is 0 here
    assert transcript.text == model.tokenizer.decode(text_tokens).strip()
    assert transcript.language == "en" and transcript.timings.windows == 1
    with pytest.raises(WhisperError, match="no timestamp tokens"):  # its vocabulary ends at <|notimestamps|>
        model.transcribe(np.zeros(16000, np.float32), timestamps=True)


def test_tiny_accepts_arrays_at_other_rates(tiny_whisper, fixtures_dir):
    import soxr
    model = Whisper(tiny_whisper)
    clip = load_audio(fixtures_dir / "whisper_features" / "clip.wav")
    at_8k = soxr.resample(clip, 16000, 8000)
    transcript = model.transcribe(at_8k, sample_rate=8000)
    assert transcript.timings.audio == pytest.approx(clip.size / 16000, abs=1e-3)
    assert transcript.segments[0].end == pytest.approx(clip.size / 16000, abs=0.01)


def test_cli_on_the_tiny_fixture(tiny_whisper, fixtures_dir, tmp_path, capsys):
    from runnx import cli
    clip = fixtures_dir / "whisper_features" / "clip.wav"
    assert cli.main(["whisper", str(tiny_whisper), str(clip), str(clip), "--format", "json"]) == 0
    out, err = capsys.readouterr()
    documents = [json.loads(line) for line in out.splitlines()]
    assert [d["file"] for d in documents] == [str(clip), str(clip)] and documents[0] == documents[1]
    assert documents[0]["language"] == "en" and documents[0]["segments"][0]["start"] == 0.0
    assert err.count("real-time factor") == 2
    assert cli.main(["whisper", str(tiny_whisper), str(clip), str(clip)]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith(f"==> {clip} <==\n") and f"\n\n==> {clip} <==\n" in out
    assert cli.main(["whisper", str(tiny_whisper), str(tmp_path / "missing.wav")]) == 2  # one line, exit 2
    assert "audio file not found" in capsys.readouterr().err
    assert cli.main(["whisper", str(tiny_whisper), str(clip), "--format", "srt"]) == 2  # srt needs timestamps
    assert "no timestamp tokens" in capsys.readouterr().err


def test_progress_bar_only_for_long_audio():
    import io
    from runnx.generate.whisper_cli import ProgressBar
    stream = io.StringIO()
    short = ProgressBar("a.wav", stream)
    short.update(10.0, 20.0)
    short.close()
    assert stream.getvalue() == ""
    bar = ProgressBar("b.wav", stream)
    bar.update(30.0, 60.0)
    bar.update(60.0, 60.0)
    bar.close()
    assert stream.getvalue().endswith("\rb.wav [" + "#" * 30 + "]   60.0/60.0 s\n")
    assert "[" + "#" * 15 + "." * 15 + "]" in stream.getvalue()


def test_a_folder_without_tokenizer_gives_ids_but_no_text(tiny_whisper, tmp_path):
    folder = _variant(tmp_path, tiny_whisper, json.loads((tiny_whisper / "generation_config.json").read_text()))
    model = Whisper(folder)
    assert model.tokenizer is None and model.tokens.start_of_transcript == 992
    with pytest.raises(WhisperError, match="tokenizer.json"):
        model.transcribe(np.zeros(16000, np.float32))


def test_folder_without_encoder_is_a_clear_error(tmp_path):
    with pytest.raises(WhisperError, match="encoder_model.onnx"):
        Whisper(tmp_path)


# -- the real tiny.en ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_en(whisper_dir):
    return Whisper(whisper_dir)


@pytest.fixture(scope="module")
def ort_tiny_en(whisper_dir):
    from _ort_whisper import OrtGreedy
    return OrtGreedy(whisper_dir)


def test_john_transcribes_exactly(tiny_en, audio_dir):
    transcript = tiny_en.transcribe(audio_dir / "john.wav")
    assert transcript.text == "Hello, my name is John and I live in London."
    assert transcript.language == "en" and len(transcript.segments) == 1
    assert transcript.timings.windows == 1 and transcript.timings.real_time_factor > 0


@pytest.mark.parametrize("clip", ["john.wav", "fox.wav", "weather.wav"])
def test_token_ids_equal_onnxruntime(tiny_en, ort_tiny_en, audio_dir, clip):
    features = mel.window_features(load_audio(audio_dir / clip))
    tokens = tiny_en.tokens
    decoded = tiny_en.decode(tiny_en.encode(features))
    expected = ort_tiny_en(features, tokens.prompt(None, "transcribe", False), eos=tokens.end_of_text,
                           suppress=tokens.suppress, begin_suppress=tokens.suppress_at_begin)
    assert decoded.tokens == expected
    transcripts = json.loads((audio_dir / "transcripts.json").read_text())
    assert tiny_en.tokenizer.decode(decoded.tokens).strip().lower()[:10] == transcripts[clip].lower()[:10]


@pytest.mark.parametrize("clip", ["john.wav", "fox.wav", "weather.wav"])
def test_timestamp_mode_token_ids_equal_transformers(tiny_en, audio_dir, fixtures_dir, clip):
    expected = json.loads((fixtures_dir / "whisper_features" / "timestamps.json").read_text())[clip]
    features = mel.window_features(load_audio(audio_dir / clip))
    assert tiny_en.decode(tiny_en.encode(features), timestamps=True).tokens == expected


def test_timestamp_mode_on_a_short_clip(tiny_en, audio_dir):
    transcript = tiny_en.transcribe(audio_dir / "john.wav", timestamps=True)
    assert "my name is John" in transcript.text
    (segment,) = transcript.segments
    assert segment.tokens[0] >= TS0 and segment.tokens[-1] >= TS0
    assert 0.0 <= segment.start < segment.end <= transcript.timings.audio


def test_long_audio_is_transcribed_across_windows(tiny_en, audio_dir):
    progress = []
    transcript = tiny_en.transcribe(audio_dir / "long.wav", progress=lambda done, total: progress.append(done))
    duration = transcript.timings.audio
    assert duration > 60 and transcript.timings.windows >= 3
    starts = [s.start for s in transcript.segments]
    ends = [s.end for s in transcript.segments]
    assert all(s < e for s, e in zip(starts, ends))
    assert all(e <= s for e, s in zip(ends, starts[1:]))  # segments follow each other
    assert starts[0] < 2.0 and ends[-1] > duration - 3.0 and ends[-1] <= duration  # they cover the audio
    assert progress == sorted(progress) and progress[-1] == pytest.approx(duration, abs=0.02)
    words = json.loads((audio_dir / "transcripts.json").read_text())["long.wav"].lower().split()
    heard = set(transcript.text.lower().replace(",", " ").replace(".", " ").split())
    assert sum(w.strip(",.") in heard for w in words) / len(words) > 0.8


def test_cli_prints_text_and_real_time_factor(whisper_dir, audio_dir, capsys):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["whisper", str(whisper_dir), str(audio_dir / "john.wav"), "--format", "srt"])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    assert out.startswith("1\n00:00:00,000 --> ") and "my name is John" in out
    assert "real-time factor" in err and "encode" in err and "decode" in err


# The recorded clip's transcript (LibriVox, tests/fixtures/README.md), in the words a reader says.
HUMAN_SPEECH = ("human_speech/sense_and_sensibility.flac",
                "and mister john dashwood had then leisure to consider how much there might be prudently in his "
                "power to do for them")


def _spoken_words(text: str) -> list[str]:
    """Lower-case words without punctuation, abbreviations spelt as said."""
    words = text.lower().replace("mr.", "mister").replace(",", " ").replace(".", " ").split()
    return [word.strip("!?;:'\"") for word in words]


def test_recorded_human_speech_transcribes_word_for_word(tiny_en, fixtures_dir):
    name, said = HUMAN_SPEECH
    transcript = tiny_en.transcribe(fixtures_dir / name)
    assert 7.0 < transcript.timings.audio < 7.2  # FLAC at 16 kHz: no resampling
    assert _spoken_words(transcript.text) == said.split(), transcript.text


def test_a_window_lets_go_of_the_last_windows_arrays_before_its_encoder_runs(tiny_whisper, fixtures_dir):
    """The decoder holds a window's encoder states (and its KV cache) after decoding it, until the next
    window's `encode`, which drops them before its encoder runs, or the end of `transcribe`: a
    transcription's peak memory holds one window's, not two, and an idle model none (held, they
    stayed alive through the next audio's features too)."""
    import weakref
    model = Whisper(tiny_whisper)
    outputs, alive_at_runs = [], []
    run = model.encoder.run

    def spied(*arguments, **options):
        alive_at_runs.append(sum(ref() is not None for ref in outputs))
        result = run(*arguments, **options)
        outputs.extend(weakref.ref(array) for array in result.values())
        return result

    model.encoder.run = spied
    features = mel.window_features(load_audio(fixtures_dir / "whisper_features" / "clip.wav"))
    hidden = model.encode(features)
    model.decode(hidden, max_new_tokens=5)
    assert model.decoder.fixed_feeds["encoder_hidden_states"] is hidden  # (inspectable after decoding)
    del hidden
    model.encode(features)
    clip = load_audio(fixtures_dir / "whisper_features" / "clip.wav")
    assert model.transcribe(np.tile(clip, 14), max_new_tokens=20).timings.windows > 1
    assert len(alive_at_runs) > 3 and alive_at_runs == [0] * len(alive_at_runs)
    assert not any(ref() is not None for ref in outputs)  # nothing held once the transcription is done
    assert model.decoder.fixed_feeds == {} and model.decoder.cache is None
