"""Small random Hugging Face models beyond the committed GPT-2 and Llama fixtures (Qwen2, Qwen3,
Mistral, Phi-3, Gemma, Gemma 3, GPT-NeoX, GPT-J, OPT, BLOOM, and BERT's masked-LM loss), each
with its own loss (`labels=`), built and exported at test time by either torch exporter, with
the batch they are exported and checked on: test_architectures.py's models, which
test_lora_architectures.py trains with LoRA.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

WEIGHT = 0.3
VOCAB = 48
MAX_T = 32

SMALL = dict(num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=MAX_T)
ROPE = dict(SMALL, hidden_size=32, intermediate_size=64, num_key_value_heads=1)
ARCHS = {
    # name: (config class, model class, config arguments, causal)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", ROPE, True),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(ROPE, head_dim=16), True),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(ROPE, sliding_window=None), True),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", ROPE, True),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(ROPE, head_dim=16), True),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(ROPE, head_dim=16, sliding_window=16), True),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(SMALL, hidden_size=32, intermediate_size=64), True),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=32, n_layer=2, n_head=2, n_positions=MAX_T, rotary_dim=8,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), True),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(SMALL, hidden_size=32, ffn_dim=64, word_embed_proj_dim=32,
                                                dropout=0.0), True),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(hidden_size=32, n_layer=2, n_head=2), True),
    "bert_mlm": ("BertConfig", "BertForMaskedLM", dict(SMALL, hidden_size=32, intermediate_size=64,
                                                       hidden_dropout_prob=0.0,
                                                       attention_probs_dropout_prob=0.0), False),
}
CASES = [(a, e) for a in ARCHS for e in ("torchscript", "dynamo") if (a, e) != ("bert_mlm", "dynamo")]


def build(arch: str, vocab: int = VOCAB, tied: bool = False, attn: str = "eager"):
    """float32 model, weights N(0, 0.2²) for matrices, 1 + N(0, 0.1²) for norms, N(0, 0.1²)
    for biases (HF's 0.02 init gives near-uniform softmaxes); `attn`: transformers'
    attn_implementation ("sdpa" is its default); returns (model, base class)."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg_name, cls_name, kwargs, causal = ARCHS[arch]
    base = getattr(transformers, cls_name)
    extra = dict(bos_token_id=2, eos_token_id=3, use_cache=False) if causal else {}
    # an encoder-decoder's own arguments may set pad_token_id: it shifts the labels right
    cfg = getattr(transformers, cfg_name)(vocab_size=vocab, tie_word_embeddings=tied, attn_implementation=attn,
                                          **{"pad_token_id": None, **extra, **kwargs})

    class WithLoss(base):
        def forward(self, input_ids, labels, attention_mask=None):
            return super().forward(input_ids=input_ids, labels=labels, attention_mask=attention_mask).loss

    torch.manual_seed(0)
    m = WithLoss(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(0.2 * r if p.dim() >= 2 else (0.1 * r if name.endswith("bias") else 1.0 + 0.1 * r))
    m.train()  # every dropout probability is 0
    return m, base


def batch(seed: int = 5):
    import generate_step

    return generate_step.batch_tensors(2, 8, seed=seed)


def export(model, exporter: str, path: Path, mask: bool = False, opset: int = 18) -> None:
    """The model with its loss (`input_ids, labels -> loss`), traced on batch(); with `mask`, an
    `attention_mask` input too (traced all ones), as a padded batch is fed. `opset`: the dynamo
    exporter's (TorchScript's is 17)."""
    ids, labels = batch()
    names = ["input_ids", "labels"] + (["attention_mask"] if mask else [])
    inputs = (ids, labels) + ((torch.ones_like(ids),) if mask else ())
    args = dict(training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                input_names=names, output_names=["loss"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            import generate_step

            with generate_step._NoPackedSequenceCheck():
                torch.onnx.export(model, inputs, str(path), dynamo=False, opset_version=17,
                                  dynamic_axes={n: {0: "B", 1: "T"} for n in names}, **args)
        else:
            import generate

            generate._patch_dynamo_version_conversion()
            b, t = torch.export.Dim("B", min=1, max=64), torch.export.Dim("T", min=2, max=MAX_T)
            # the value metadata stays: it records which initializers are buffers
            prog = torch.onnx.export(model, inputs, dynamo=True, opset_version=opset, optimize=False,
                                     external_data=False, verbose=False,
                                     dynamic_shapes={n: {0: b, 1: t} for n in names}, **args)
            prog.save(str(path))


def reference(model, base, causal: bool, ids, labels, attention_mask=None):
    """torch float64 (total, ce, ntl, {parameter the loss reads: gradient}) of the model's own
    cross-entropy + 0.3·ntloss on the logits and labels it reads (shifted for the causal LMs)."""
    import copy

    import ntl_torch
    import torch.nn.functional as F

    m = copy.deepcopy(model).double()
    params = dict(m.named_parameters())
    # an encoder-decoder's decoder reads the labels shifted right, as under the model's own loss
    decoder = dict(labels=labels) if m.config.is_encoder_decoder else {}
    logits = base.forward(m, input_ids=ids, attention_mask=attention_mask, **decoder).logits
    y = F.pad(labels, (0, 1), value=-100)[..., 1:] if causal else labels
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
    with torch.no_grad():  # HF's loss casts the logits to float32 first
        own = float(m(ids, labels, attention_mask))
        assert abs(own - float(ce)) <= 1e-6 * float(ce), "the reference CE is the model's own"
    obj = ntl_torch.ntloss_object("wasserstein", vocab_size=logits.shape[-1])
    ntl = ntl_torch.ntl_value(obj, logits, y)
    total = ce + WEIGHT * ntl
    # parameters the loss does not read (BERT's pooler) get no gradient, and train in neither
    grads = torch.autograd.grad(total, list(params.values()), allow_unused=True)
    return float(total), float(ce), float(ntl), {k: g.numpy() for k, g in zip(params, grads) if g is not None}
