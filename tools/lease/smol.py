"""SmolLM2-135M-Instruct's GGUF (Q4_1, dequantized by transformers) saved as model folders in
bfloat16 and float32, so that each samctl command of the lease loads it in a second.

    python3 tools/lease/smol.py MODEL.gguf DIR   # -> DIR/smol-bfloat16, DIR/smol-float32
"""
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path, out = sys.argv[1:3]
folder, name = os.path.split(os.path.abspath(path))
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
model.hf_quantizer = None  # dequantized already: plain weights from here on
vars(model.config).pop("quantization_config", None)
for dtype in (torch.float32, torch.bfloat16):  # float32 first: bfloat16 rounds
    target = os.path.join(out, "smol-" + str(dtype).removeprefix("torch."))
    model.to(dtype).save_pretrained(target)
    tokenizer.save_pretrained(target)
    print("saved", target, flush=True)
