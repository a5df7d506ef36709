"""Vision and transformer helpers: NonMaxSuppression, RotaryEmbedding (opset 23), ImageDecoder.

ImageDecoder delegates to Pillow when it is installed (an optional dependency: runnx writes no image
codecs of its own); without it the kernel raises a RunnxError that says so.
"""
from __future__ import annotations

import io

import numpy as np

from runnx.errors import RunnxError
from runnx.ops.registry import register


def _corners(boxes: np.ndarray, center_point_box: int) -> np.ndarray:
    """Boxes as (y_min, x_min, y_max, x_max) whatever the input convention or corner order."""
    boxes = boxes.astype(np.float64)
    if center_point_box:
        x, y, w, h = boxes[..., 0], boxes[..., 1], boxes[..., 2], boxes[..., 3]
        return np.stack([y - h / 2, x - w / 2, y + h / 2, x + w / 2], axis=-1)
    y1, x1, y2, x2 = boxes[..., 0], boxes[..., 1], boxes[..., 2], boxes[..., 3]
    return np.stack([np.minimum(y1, y2), np.minimum(x1, x2), np.maximum(y1, y2), np.maximum(x1, x2)], axis=-1)


def _iou_matrix(corners: np.ndarray) -> np.ndarray:
    area = (corners[:, 2] - corners[:, 0]) * (corners[:, 3] - corners[:, 1])
    top = np.maximum(corners[:, None, 0], corners[None, :, 0])
    left = np.maximum(corners[:, None, 1], corners[None, :, 1])
    bottom = np.minimum(corners[:, None, 2], corners[None, :, 2])
    right = np.minimum(corners[:, None, 3], corners[None, :, 3])
    intersection = np.clip(bottom - top, 0, None) * np.clip(right - left, 0, None)
    union = area[:, None] + area[None, :] - intersection
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(union > 0, intersection / union, 0.0)


@register("NonMaxSuppression", since=10)
def NonMaxSuppression(boxes, scores, max_output_boxes_per_class=None, iou_threshold=None, score_threshold=None, *,
                      center_point_box: int = 0):
    limit = 0 if max_output_boxes_per_class is None else int(np.asarray(max_output_boxes_per_class).reshape(-1)[0])
    iou_limit = 0.0 if iou_threshold is None else float(np.asarray(iou_threshold).reshape(-1)[0])
    score_floor = None if score_threshold is None else float(np.asarray(score_threshold).reshape(-1)[0])
    if boxes.shape[0] != scores.shape[0] or boxes.shape[1] != scores.shape[2]:
        raise RunnxError(f"boxes {boxes.shape} and scores {scores.shape} do not match")
    selected = []
    for batch in range(boxes.shape[0]):
        iou = _iou_matrix(_corners(boxes[batch], center_point_box))
        for cls in range(scores.shape[1]):
            class_scores = scores[batch, cls]
            order = np.argsort(-class_scores, kind="stable")
            if score_floor is not None:
                order = order[class_scores[order] > score_floor]
            kept: list[int] = []
            for box in order:  # greedy: a box survives unless it overlaps a kept one too much
                if len(kept) >= limit:
                    break
                if not kept or not (iou[box, kept] > iou_limit).any():
                    kept.append(int(box))
            selected.extend((batch, cls, box) for box in kept)
    return np.array(selected, dtype=np.int64).reshape(-1, 3)


@register("RotaryEmbedding", since=23)
def RotaryEmbedding(x, cos_cache, sin_cache, position_ids=None, *, interleaved: int = 0, num_heads: int = 0,
                    rotary_embedding_dim: int = 0):
    if x.ndim == 4:  # (batch, heads, seq, head) -> (batch, seq, heads, head)
        work = x.transpose(0, 2, 1, 3)
    elif x.ndim == 3:
        if not num_heads:
            raise RunnxError("RotaryEmbedding on a 3-d input needs num_heads")
        work = x.reshape(x.shape[0], x.shape[1], num_heads, -1)
    else:
        raise RunnxError(f"RotaryEmbedding expects a 3-d or 4-d input, got shape {x.shape}")
    rotated_dim = rotary_embedding_dim or work.shape[-1]
    half = rotated_dim // 2
    if position_ids is not None:
        cos_cache, sin_cache = cos_cache[position_ids], sin_cache[position_ids]
    if cos_cache.shape[-1] != half or sin_cache.shape[-1] != half:
        raise RunnxError(f"cos/sin caches end in {cos_cache.shape[-1]}, expected rotary_dim/2 = {half}")
    cos, sin = cos_cache[:, :, None, :], sin_cache[:, :, None, :]  # (batch, seq, 1, half)
    out = work.copy()
    part = work[..., :rotated_dim]
    if interleaved:
        first, second = part[..., 0::2], part[..., 1::2]
        out[..., 0:rotated_dim:2] = cos * first - sin * second
        out[..., 1:rotated_dim:2] = sin * first + cos * second
    else:
        first, second = part[..., :half], part[..., half:]
        out[..., :half] = cos * first - sin * second
        out[..., half:rotated_dim] = sin * first + cos * second
    return out.transpose(0, 2, 1, 3) if x.ndim == 4 else out.reshape(x.shape)


@register("ImageDecoder", since=20)
def ImageDecoder(encoded_stream, *, pixel_format: str = "RGB"):
    if pixel_format not in ("RGB", "BGR", "Grayscale"):
        raise RunnxError(f"ImageDecoder pixel_format must be RGB, BGR or Grayscale, got '{pixel_format}'")
    try:
        from PIL import Image  # optional dependency, imported only when a model decodes images
    except ImportError as error:
        raise RunnxError("ImageDecoder needs Pillow, which is not installed (pip install pillow)") from error
    try:
        image = Image.open(io.BytesIO(np.asarray(encoded_stream, dtype=np.uint8).tobytes()))
        pixels = np.asarray(image.convert("L" if pixel_format == "Grayscale" else "RGB"))
    except (OSError, ValueError) as error:
        raise RunnxError(f"ImageDecoder cannot decode the stream: {error}") from error
    if pixel_format == "Grayscale":
        return np.ascontiguousarray(pixels[:, :, None])
    return np.ascontiguousarray(pixels[:, :, ::-1] if pixel_format == "BGR" else pixels)
