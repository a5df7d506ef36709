"""Quantize an ONNX model's MatMul weights to 4-bit NF4 or FP4 with onnxruntime's own tool, as
transformers.js's quantize script does for its `bnb4` files:

    python quantize_bnb4.py SOURCE.onnx OUT.onnx [--quant-type nf4|fp4] [--block-size 64]

onnxruntime.quantization.matmul_bnb4_quantizer (bitsandbytes' 4-bit codes, one absmax per block of
the flattened transposed weight) rewrites every MatMul with a constant 2-D weight into
com.microsoft MatMulBnb4; the rest of the graph is unchanged. onnxruntime's CPU kernel takes float32
activations only, so SOURCE is a float32 model.
"""
import argparse

import onnx
from onnxruntime.quantization.matmul_bnb4_quantizer import MatMulBnb4Quantizer

QUANT_TYPES = {"fp4": MatMulBnb4Quantizer.FP4, "nf4": MatMulBnb4Quantizer.NF4}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--quant-type", choices=sorted(QUANT_TYPES), default="nf4")
    parser.add_argument("--block-size", type=int, default=64)
    args = parser.parse_args()
    quantizer = MatMulBnb4Quantizer(onnx.load(args.source), QUANT_TYPES[args.quant_type], args.block_size)
    quantizer.process()
    quantizer.model.save_model_to_file(args.out, use_external_data_format=False)


if __name__ == "__main__":
    main()
