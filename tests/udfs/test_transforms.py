"""udfs/transforms.py: the one raw-columns -> batch-arrays implementation (ETL, score, served model)."""
import io
import pickle

import numpy as np
import pyarrow as pa
import pytest

from udfs.transforms import (LARGE_VOCABULARY, Transform, VocabularyIndex, decode_image, hash_ids, stable_hash,
                             text_ids, vector_matrix, vocab_ids)


def _png(pixels: np.ndarray, mode: str) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels, mode).save(buffer, "PNG")
    return buffer.getvalue()


def test_numeric_impute_flag_and_standardize():
    spec = dict(name="a", type="numeric", impute="median", fill=5.0, missing_flag=True, standardize=True,
                mean=4.0, std=2.0)
    table = pa.table({"a": pa.array([2.0, None, float("nan"), 8.0])})
    arrays, valid, counts, _ = Transform([spec], {}).apply(table)
    assert arrays["numeric"].tolist() == [[-1.0, 0.0], [0.5, 1.0], [0.5, 1.0], [2.0, 0.0]]
    assert valid.all() and counts == {}
    strict = dict(spec, impute=None, missing_flag=False)
    arrays, valid, counts, _ = Transform([strict], {}).apply(table)
    assert valid.tolist() == [True, False, False, True] and counts == {"a": 2}


def test_vocabulary_ids_are_the_same_through_the_large_vocabulary_index():
    vocabulary = pa.array([f"v{i}" for i in range(LARGE_VOCABULARY + 10)])
    values = pa.array(["v3", None, "unseen", f"v{LARGE_VOCABULARY + 9}", "v0"])
    expected = [5, 0, 1, LARGE_VOCABULARY + 11, 2]
    assert vocab_ids(values, vocabulary).tolist() == expected
    index = pickle.loads(pickle.dumps(VocabularyIndex(vocabulary)))  # crosses into Spark tasks
    assert vocab_ids(values, index).tolist() == expected
    spec = dict(name="c", type="categorical")
    assert Transform([spec], {"c": vocabulary}).apply(pa.table({"c": values}))[0]["c"].tolist() == expected


def test_integer_and_whole_float_categories_map_alike_and_hashes_are_stable():
    spec = dict(name="c", type="categorical")
    vocabulary = pa.array(["3", "7"])
    ints = Transform([spec], {"c": vocabulary}).apply(pa.table({"c": pa.array([7, 3, 9, None])}))[0]["c"]
    floats = Transform([spec], {"c": vocabulary}).apply(pa.table({"c": pa.array([7.0, 3.0, 9.0, None])}))[0]["c"]
    assert ints.tolist() == floats.tolist() == [3, 2, 1, 0]
    assert stable_hash("city") == stable_hash("city") != stable_hash("City")
    ids = hash_ids(pa.array(["a", "b", None, "a"]), 1000)
    assert ids[0] == ids[3] and ids[2] == 0 and 1 <= ids[[0, 1]].min() and ids.max() <= 1000


def test_text_is_tokenized_padded_truncated_with_lengths():
    spec = dict(name="t", type="text", max_len=3, tokenize=True)
    vocabulary = pa.array(["apple", "red", "pear"])
    ids, lengths = text_ids(pa.array(["Red apple!", "pear, PEAR, pear, apple", None, "kiwi"]), spec, vocabulary)
    assert ids.tolist() == [[3, 2, 0], [4, 4, 4], [0, 0, 0], [1, 0, 0]]
    assert lengths.tolist() == [2, 3, 0, 1]
    tokens = dict(spec, tokenize=False)
    ids, lengths = text_ids(pa.array([[7, 3], [3, 3, 3, 3]], pa.list_(pa.int64())), tokens, pa.array(["3", "7"]))
    assert ids.tolist() == [[3, 2, 0], [2, 2, 2]] and lengths.tolist() == [2, 3]


def test_vector_length_and_values_are_checked():
    values, invalid = vector_matrix(pa.array([[1.0, 2.0], [1.0], None, [np.inf, 0.0]]), 2)
    assert invalid.tolist() == [False, True, True, True]
    assert values[0].tolist() == [1.0, 2.0] and values.dtype == np.float32


def test_images_are_decoded_converted_and_resized():
    gray = np.arange(16, dtype=np.uint8).reshape(4, 4) * 10
    assert np.array_equal(decode_image(_png(gray, "L"), 4, 4, 1)[0], gray)
    rgb = np.zeros((6, 8, 3), dtype=np.uint8)
    rgb[..., 0] = 200
    out = decode_image(_png(rgb, "RGB"), 3, 4, 3)
    assert out.shape == (3, 3, 4) and (out[0] == 200).all() and (out[1:] == 0).all()  # CHW, resized
    assert decode_image(_png(rgb, "RGB"), 6, 8, 1).shape == (1, 6, 8)  # converted to one channel
    with pytest.raises(Exception):
        decode_image(b"\x89PNG broken", 4, 4, 1)


def test_check_agrees_with_apply_on_invalid_rows():
    specs = [dict(name="v", type="vector", length=2), dict(name="img", type="image", height=2, width=2, channels=1),
             dict(name="n", type="numeric")]
    table = pa.table({"v": pa.array([[1.0, 2.0], [1.0], [3.0, 4.0]]),
                      "img": pa.array([_png(np.zeros((2, 2), np.uint8), "L"), _png(np.zeros((2, 2), np.uint8), "L"),
                                       b"bad"]),
                      "n": pa.array([1.0, 2.0, None])})
    transform = Transform(specs, {})
    invalid, counts, error = transform.check(table)
    _, valid, applied, _ = transform.apply(table)
    assert invalid.tolist() == (~valid).tolist() == [False, True, True]
    assert counts == applied == {"v": 1, "img": 1, "n": 1} and error
