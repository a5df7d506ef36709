"""Quantize an ONNX model's MatMul weights to 4 bits with onnxruntime's own tool, as users do:

    python quantize_nbits.py SOURCE.onnx OUT.onnx [--block-size 32]

onnxruntime.quantization.matmul_nbits_quantizer (asymmetric, per-block zero points) rewrites every
MatMul with a constant weight into com.microsoft MatMulNBits; the rest of the graph is unchanged.
"""
import argparse

import onnx
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--block-size", type=int, default=32)
    args = parser.parse_args()
    quantizer = MatMulNBitsQuantizer(onnx.load(args.source), block_size=args.block_size, is_symmetric=False)
    quantizer.process()
    quantizer.model.save_model_to_file(args.out, use_external_data_format=False)


if __name__ == "__main__":
    main()
