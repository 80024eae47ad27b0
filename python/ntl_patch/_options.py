"""The command-line options of each `ntl-patch` command, as the Python wrappers accept them.

One table, kept equal to the binary's `--help` by tests/python/test_api.py. Python names are the
flags in snake_case (``--max-grad-norm`` -> ``max_grad_norm``). Kinds:
  FLAG   a switch: True -> ``--flag``; False / None -> left out
  VALUE  one value: ``--flag VALUE``; None -> left out
  MULTI  repeatable: a list/tuple -> ``--flag A --flag B``; one value -> ``--flag A``
VALUE options in COMMA_LISTS also take a list/tuple of strings, joined with commas
(``lora_targets=["q_proj", "v_proj"]`` -> ``--lora-targets=q_proj,v_proj``).
"""

from __future__ import annotations

FLAG, VALUE, MULTI = "flag", "value", "multi"

_LOSS = {
    "loss": VALUE, "weight": VALUE, "reweigh": FLAG, "squash": VALUE, "digit_level": FLAG,
    "all_numbers": FLAG, "combine": VALUE, "digit_exp": VALUE, "abs_alpha": VALUE,
    "mag_alpha": VALUE, "digit_alpha": VALUE, "gumbel_tau": VALUE, "gumbel_noise": VALUE,
    "float_level": FLAG, "label_smoothing": VALUE, "dist2_tau": VALUE, "max_value": VALUE,
    "kernel": VALUE, "sigma": MULTI, "smmd_alpha": VALUE, "smmd_terms": VALUE,
}
_SOURCE = {"tokenizer": VALUE, "vocab_size": VALUE, "ce_node": VALUE, "add_loss": FLAG,
           "no_shift": FLAG}
_OPTIMIZER = {
    "optimizer": VALUE, "lr": VALUE, "beta1": VALUE, "beta2": VALUE, "eps": VALUE,
    "weight_decay": VALUE, "momentum": VALUE, "max_grad_norm": VALUE, "freeze": MULTI,
    "split": FLAG, "precision": VALUE, "init_scale": VALUE, "growth_factor": VALUE,
    "backoff_factor": VALUE, "growth_interval": VALUE, "fused_head": VALUE,
    "head_chunk_tokens": VALUE, "lora_r": VALUE, "lora_alpha": VALUE, "lora_targets": VALUE,
    "use_rslora": FLAG, "lora_init": VALUE, "lora_dropout": VALUE, "seed": VALUE, "train": MULTI,
    "recompute": VALUE, "batch": VALUE, "seq": VALUE, "attention": VALUE,
    "attention_block": VALUE, "quantize_base": VALUE, "quant_block": VALUE,
    "quantize_targets": VALUE, "double_quant": FLAG, "update_bucket": VALUE,
}

# one-value options whose value is a comma-separated list
COMMA_LISTS = {"lora_targets", "quantize_targets"}

# command -> {python option name: kind}; `out` is the wrappers' name for -o/--output
OPTIONS: dict[str, dict[str, str]] = {
    "patch": {**_LOSS, **_SOURCE, "out": VALUE, "copy_external_data": FLAG},
    "step": {**_LOSS, **_SOURCE, **_OPTIMIZER, "out": VALUE, "copy_external_data": FLAG},
    "artifacts": {**_LOSS, **_SOURCE, "out": VALUE},
    "validate": {"runtime": VALUE, "reference": VALUE, "tokenizer": VALUE, "rtol": VALUE,
                 "atol": VALUE, "batch": VALUE, "seq": VALUE, "seed": VALUE},
    "inspect": {"target": MULTI},
    "lora-model": {"step": VALUE, "out": VALUE, "copy_external_data": FLAG},
}


def flag(name: str) -> str:
    """The CLI flag of a Python option name."""
    return "--output" if name == "out" else "--" + name.replace("_", "-")
