"""String ops on object arrays of str: stopwords and case, split padding, full-match regexes,
broadcast concatenation, and the ai.onnx.ml LabelEncoder's lookups and defaults."""
import numpy as np
import pytest
from _single_node import run_node

from runnx.errors import InvalidModelError
from runnx.ops.string import LabelEncoder, LabelEncoder_1


def _strings(*values):
    return np.array(values, dtype=object)


def test_string_normalizer_drops_stopwords_ignoring_case_then_changes_case():
    got = run_node("StringNormalizer", [_strings("Monday", "tuesday", "MONDAY")], stopwords=["monday"],
                   case_change_action="UPPER")
    assert got.tolist() == ["TUESDAY"]
    kept = run_node("StringNormalizer", [_strings("Monday", "monday").reshape(1, 2)], stopwords=["monday"],
                    is_case_sensitive=1)
    assert kept.tolist() == [["Monday"]]
    assert run_node("StringNormalizer", [_strings("a", "A")], stopwords=["a"]).tolist() == [""]


def test_string_split_pads_to_the_longest_and_counts():
    parts, counts = run_node("StringSplit", [_strings("a-b-c", "", "d")], outputs=2, delimiter="-", maxsplit=1,
                             opset=20)
    assert parts.tolist() == [["a", "b-c"], ["", ""], ["d", ""]]
    assert counts.tolist() == [2, 1, 1] and counts.dtype == np.int64
    # no delimiter: runs of whitespace separate, as str.split()
    parts, counts = run_node("StringSplit", [_strings(" x  y ", "")], outputs=2, opset=20)
    assert parts.tolist() == [["x", "y"], ["", ""]] and counts.tolist() == [2, 0]


def test_regex_full_match_and_string_concat_broadcast():
    matched = run_node("RegexFullMatch", [_strings("ab12", "ab12x").reshape(2, 1)], pattern=r"[a-z]+\d+", opset=20)
    assert matched.tolist() == [[True], [False]] and matched.dtype == bool
    joined = run_node("StringConcat", [_strings("a", "b"), np.array("!", dtype=object)], opset=20)
    assert joined.tolist() == ["a!", "b!"] and joined.dtype == object
    scalar = run_node("StringConcat", [np.array("é", dtype=object), np.array("x", dtype=object)], opset=20)
    assert scalar.shape == () and scalar.item() == "éx"


def test_label_encoder_maps_with_defaults_and_tensor_tables():
    x = _strings("a", "z", "b")
    assert LabelEncoder(x, keys_strings=("a", "b"), values_int64s=(5, 6)).tolist() == [5, -1, 6]
    floats = LabelEncoder(np.array([1, 3], np.int64), keys_int64s=(1,), values_floats=(0.5,), default_float=2.0)
    assert floats.tolist() == [0.5, 2.0] and floats.dtype == np.float32
    keyed = LabelEncoder(np.array([0.1, 0.2], np.float32), keys_floats=(0.1,), values_strings=("x",))
    assert keyed.tolist() == ["x", "_Unused"]
    table = LabelEncoder(x, keys_strings=("a",), values_tensor=np.array([7], np.int16),
                         default_tensor=np.array([9], np.int16))
    assert table.tolist() == [7, 9, 9] and table.dtype == np.int16
    assert LabelEncoder_1(x, classes_strings=("b", "a")).tolist() == [1, -1, 0]
    assert LabelEncoder_1(np.array([1, 4], np.int64), classes_strings=("b", "a")).tolist() == ["a", "_Unused"]
    with pytest.raises(InvalidModelError):
        LabelEncoder(x, keys_strings=("a",), values_int64s=(1, 2))


def test_tfidf_counts_skip_grams_and_unigrams_once():
    x = np.array([1, 2, 1, 3, 2], np.int64)
    table = dict(pool_int64s=[1, 2, 3, 1, 2], ngram_counts=[0, 3], ngram_indexes=[0, 1, 2, 3], max_gram_length=2,
                 max_skip_count=1)
    # bigram (1, 2): adjacent at 0-1, and two apart at 2-4
    np.testing.assert_array_equal(run_node("TfIdfVectorizer", [x], mode="TF", min_gram_length=1, **table),
                                  [2, 2, 1, 2])
    np.testing.assert_array_equal(run_node("TfIdfVectorizer", [x[None]], mode="TF", min_gram_length=2, **table),
                                  [[0, 0, 0, 2]])
    weights = [0.5, 1, 1, 3]
    np.testing.assert_array_equal(
        run_node("TfIdfVectorizer", [x], mode="IDF", min_gram_length=1, weights=weights, **table), [0.5, 1, 1, 3])
    np.testing.assert_array_equal(
        run_node("TfIdfVectorizer", [x], mode="TFIDF", min_gram_length=1, weights=weights, **table), [1, 2, 1, 6])
