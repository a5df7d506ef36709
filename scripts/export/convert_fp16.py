"""Convert an ONNX model's float tensors to float16 with onnxruntime's own converter, as the
transformers.js `model_fp16.onnx` files are made:

    python convert_fp16.py SOURCE.onnx OUT.onnx

onnxruntime.transformers.float16.convert_float_to_float16 (the onnxconverter-common converter
onnxruntime ships) turns every float32 initializer, value and graph input/output into float16,
leaving its default block list (Range, Min, Max, TopK, CumSum, ...) in float32 behind Casts.
keep_io_types=False: like an Optimum `--dtype fp16` export, the past key/values are fed and the
logits and presents returned in float16, so the KV cache is kept in float16 too.
"""
import argparse

import onnx
from onnxruntime.transformers.float16 import convert_float_to_float16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source")
    parser.add_argument("out")
    args = parser.parse_args()
    model = convert_float_to_float16(onnx.load(args.source), keep_io_types=False)
    onnx.save(model, args.out)


if __name__ == "__main__":
    main()
