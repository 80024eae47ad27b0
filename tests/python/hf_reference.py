"""The transformers GPT-2 / Llama fixtures and their torch references: the four exports (both
torch exporters, each model with its own loss, HF's shifted cross-entropy) and
fixtures/reference/step/<gpt2|llama>.npz from fixtures/generate_step.py (float64 losses and
gradients, and the 20-step AdamW / SGD trajectories), as test_step.py, test_recompute.py and
test_attention*.py read them.
"""

from __future__ import annotations

import numpy as np

from conftest import MODELS

HF_MODELS = ["gpt2_ts", "gpt2_dynamo", "llama_ts", "llama_dynamo"]
STEP_REF = MODELS.parent / "reference" / "step"


def hf_reference(model: str):
    return np.load(STEP_REF / f"{model.split('_')[0]}.npz")
