"""Quantize an ONNX model's weights to int8 with onnxruntime's own tool, as transformers.js's
model_quantized.onnx files are made:

    python quantize_int8.py SOURCE.onnx OUT.onnx

onnxruntime.quantization.quantize_dynamic (QInt8 weights, reduce_range=True) rewrites every MatMul
with a constant weight into DynamicQuantizeLinear + MatMulInteger. reduce_range keeps the weights in
7 bits, so onnxruntime's u8 x s8 MatMulInteger cannot saturate its 16-bit pair sums on AVX2 and
stays an exact reference for runnx's tests. EnableSubgraph quantizes the MatMuls inside a merged
decoder's If branches too (as transformers.js's quantize script does); without it a
decoder_model_merged.onnx comes out unquantized.
"""
import argparse

from onnxruntime.quantization import QuantType, quantize_dynamic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source")
    parser.add_argument("out")
    args = parser.parse_args()
    quantize_dynamic(args.source, args.out, weight_type=QuantType.QInt8, reduce_range=True,
                     extra_options={"EnableSubgraph": True})


if __name__ == "__main__":
    main()
