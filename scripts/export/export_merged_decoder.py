"""Export a decoder-only Hugging Face model the way Optimum did before it exported one `model.onnx`:
decoder_model.onnx (no past in), decoder_with_past_model.onnx, and decoder_model_merged.onnx that
joins them under one `If` on `use_cache_branch` (the past KV then reaches the attention Concat only
through a subgraph capture, the case runnx moves values into).

    python export_merged_decoder.py HF_DIR OUT_DIR

optimum-onnx 0.1.0 no longer does this for decoder-only models by itself, but keeps the pieces:
export_models + the config's post-processing (tied-weight de-duplication, merge_decoders).
Runs in the export venv.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from optimum.exporters.onnx import export_models
from optimum.exporters.tasks import TasksManager
from transformers import AutoModelForCausalLM

TASK = "text-generation-with-past"


def export(hf_dir: Path, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.config.use_cache = True
    make_config = TasksManager.get_exporter_config_constructor(exporter="onnx", model=model, task=TASK,
                                                              library_name="transformers")
    submodels = {
        "decoder_model": (model, make_config(model.config, use_past=True, use_past_in_inputs=False)),
        "decoder_with_past_model": (model, make_config(model.config, use_past=True, use_past_in_inputs=True)),
    }
    file_names = [f"{name}.onnx" for name in submodels]
    export_models(models_and_onnx_configs=submodels, output_dir=out_dir, output_names=file_names)
    # The no-past config's post-processing merges the two decoders into decoder_model_merged.onnx.
    submodels["decoder_model"][1].post_process_exported_models(out_dir, submodels, file_names)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: export_merged_decoder.py HF_DIR OUT_DIR")
    start = time.monotonic()
    export(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"exported {sys.argv[2]} in {time.monotonic() - start:.1f}s")
