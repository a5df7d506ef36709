"""Loading, IR, planning and execution of ONNX graphs."""
