"""Build a tiny random-weight Qwen3-MoE model directory for tests, demos and benchmarks."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pathlib

    import torch

__all__ = ["TINY_MODEL_SPEC", "TinyModelSpec", "build_tiny_model", "tiny_model_engine_args"]

_ENDOFTEXT = "<|endoftext|>"


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Shape of the model that `build_tiny_model` writes; tests assert routed experts against it."""

    num_layers: int = 4
    # A dense layer in the middle (not first or last) checks that consumers keep the layer axis
    # aligned: vLLM reports its slot as all zeros rather than dropping it.
    dense_layers: tuple[int, ...] = (1,)
    num_experts: int = 8
    top_k: int = 2
    hidden_size: int = 128
    # head_dim = hidden_size / heads = 32, the smallest head size vLLM's CPU attention supports.
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    moe_intermediate_size: int = 64
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    bos_token: str = _ENDOFTEXT
    eos_token: str = _ENDOFTEXT
    # Special tokens take the first ids, in this order, so their ids are stable.
    special_tokens: tuple[str, ...] = (_ENDOFTEXT, "<|im_start|>", "<|im_end|>")

    @property
    def head_dim(self) -> int:
        """Size of one attention head (Qwen3MoeConfig derives it the same way)."""
        return self.hidden_size // self.num_attention_heads

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the decoder layers that route tokens to experts."""
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)

    @property
    def eos_token_id(self) -> int:
        """Token id of the end-of-sequence token."""
        return self.special_tokens.index(self.eos_token)


TINY_MODEL_SPEC = TinyModelSpec()

# ChatML, as Qwen uses; assistant turns end with <|im_end|>, which is not the EOS token, so chat
# callers that want a natural stop pass it as a stop token.
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Training text for the tokenizer. It only has to be varied enough to yield `vocab_size` tokens;
# the model's weights are random, so what it says does not matter.
_CORPUS = """\
Kafka keeps records in partitions, and every partition is an ordered, immutable log. A consumer
reads a partition from an offset and commits the next offset it wants to read after a restart.
When a worker fails before committing, the records after the last commit are delivered again, so
the pipeline is at-least-once and downstream readers deduplicate by job identifier.

A mixture-of-experts layer replaces one large feed-forward block with many small experts and a
router. For every token the router scores each expert, keeps the top few, and mixes their outputs
with weights from a softmax. Reinforcement learning trainers record which experts were chosen
during generation, then replay the same routing in the training forward pass, because a router
that picks different experts at training time changes the policy that produced the sample.

The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How
vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. Numbers such as 0, 1, 2,
3, 4, 5, 6, 7, 8, 9, 10, 42, 256, 1024 and 65536 appear in logs, configs and error messages.

Weather report: morning fog over the harbour, clearing by noon; light winds from the west,
rising in the evening; temperatures between twelve and nineteen degrees. Tomorrow brings rain
in the hills, sunshine along the coast, and a chance of thunder late at night.

Recipe: whisk two eggs with a cup of milk, fold in flour and a pinch of salt, rest the batter
for ten minutes, then cook thin pancakes in a hot buttered pan, turning each one once.

def add(a, b):
    return a + b

for i in range(10):
    print(i * i)

{"job_id": "abc-123", "prompt": "Hello, world!", "max_tokens": 16, "temperature": 0.7}
"""


def tiny_model_engine_args(model_dir: pathlib.Path) -> list[str]:
    """vLLM engine arguments that serve the tiny model with routed-experts capture on a CPU.

    Eager mode because the compiled CPU path silently captures all zeros; float32 so the routing
    matches HF transformers' fp32 router exactly.
    """
    return [
        *("--model", str(model_dir), "--enforce-eager", "--dtype", "float32"),
        *("--max-model-len", "512", "--max-num-seqs", "8", "--seed", "0"),
    ]


def build_tiny_model(
    out_dir: pathlib.Path, *, seed: int = 0, spec: TinyModelSpec = TINY_MODEL_SPEC
) -> pathlib.Path:
    """Write a random-weight Qwen3-MoE checkpoint and tokenizer to `out_dir` and return it.

    The directory loads in vLLM and in HF transformers (config.json, model.safetensors in the
    per-expert Qwen3-MoE checkpoint layout, tokenizer.json, tokenizer_config.json). Nothing is
    downloaded. The same seed gives byte-identical files, so a cached copy can be reused.
    `spec` other than the tiny one is for benchmarks that need bytes to move (a ~1 GB model
    for the reload's throughput); tests use the tiny one.
    """
    # Heavy imports stay inside the functions so that importing `worker` stays light.
    from safetensors.torch import save_file  # noqa: PLC0415
    from transformers import Qwen3MoeConfig  # noqa: PLC0415

    out_dir.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(out_dir, spec)

    config = Qwen3MoeConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k,
        mlp_only_layers=list(spec.dense_layers),
        decoder_sparse_step=1,
        # Qwen3-30B-A3B renormalises the top-k weights; copying that keeps the block realistic.
        norm_topk_prob=True,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=spec.special_tokens.index(spec.bos_token),
        eos_token_id=spec.eos_token_id,
        pad_token_id=spec.eos_token_id,
        architectures=["Qwen3MoeForCausalLM"],
        dtype="float32",
    )
    config.save_pretrained(out_dir)

    tensors = _random_weights(spec, seed)
    # Fixed metadata (no timestamps, no versions) keeps the file byte-identical for a seed.
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _random_weights(spec: TinyModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Draw every tensor of the checkpoint from one seeded generator, in a fixed order."""
    import torch  # noqa: PLC0415

    generator = torch.Generator().manual_seed(seed)
    h = spec.hidden_size
    q_dim = spec.num_attention_heads * spec.head_dim
    kv_dim = spec.num_key_value_heads * spec.head_dim

    def linear(out_features: int, in_features: int, *, gain: float = 1.0) -> torch.Tensor:
        # Scaled by 1/sqrt(fan_in) so activations stay near unit size through every layer.
        std = gain / math.sqrt(in_features)
        return torch.randn(out_features, in_features, generator=generator) * std

    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(spec.vocab_size, h, generator=generator),
    }
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(h)
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(h)
        tensors[f"{p}.self_attn.q_proj.weight"] = linear(q_dim, h)
        tensors[f"{p}.self_attn.k_proj.weight"] = linear(kv_dim, h)
        tensors[f"{p}.self_attn.v_proj.weight"] = linear(kv_dim, h)
        tensors[f"{p}.self_attn.o_proj.weight"] = linear(h, q_dim)
        tensors[f"{p}.self_attn.q_norm.weight"] = torch.ones(spec.head_dim)
        tensors[f"{p}.self_attn.k_norm.weight"] = torch.ones(spec.head_dim)
        if i in spec.dense_layers:
            tensors[f"{p}.mlp.gate_proj.weight"] = linear(spec.intermediate_size, h)
            tensors[f"{p}.mlp.up_proj.weight"] = linear(spec.intermediate_size, h)
            tensors[f"{p}.mlp.down_proj.weight"] = linear(h, spec.intermediate_size)
            continue
        # A router logit spread of several units keeps the top-k margins far above fp32 rounding,
        # so vLLM and HF transformers choose the same experts and tests can compare ids exactly.
        tensors[f"{p}.mlp.gate.weight"] = linear(spec.num_experts, h, gain=4.0)
        for e in range(spec.num_experts):
            ep = f"{p}.mlp.experts.{e}"
            tensors[f"{ep}.gate_proj.weight"] = linear(spec.moe_intermediate_size, h)
            tensors[f"{ep}.up_proj.weight"] = linear(spec.moe_intermediate_size, h)
            tensors[f"{ep}.down_proj.weight"] = linear(h, spec.moe_intermediate_size)
    tensors["model.norm.weight"] = torch.ones(h)
    tensors["lm_head.weight"] = linear(spec.vocab_size, h)
    # safetensors refuses tensors that share or do not own contiguous storage.
    return {name: t.contiguous() for name, t in tensors.items()}


def _build_tokenizer(out_dir: pathlib.Path, spec: TinyModelSpec) -> None:
    """Train a byte-level BPE tokenizer on the built-in corpus and save it in HF format."""
    from tokenizers import (  # noqa: PLC0415
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    # Byte-level pre-tokenisation makes every string encodable without an unknown token.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(spec.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    # Every id the model can sample must decode, so the tokenizer must fill the model's vocab.
    if tokenizer.get_vocab_size() != spec.vocab_size:
        raise RuntimeError(
            f"tokenizer has {tokenizer.get_vocab_size()} tokens, expected {spec.vocab_size}; "
            "the built-in corpus is too small"
        )
    tokenizer.save(str(out_dir / "tokenizer.json"))

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos_token,
        "eos_token": spec.eos_token,
        "pad_token": spec.eos_token,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": _CHAT_TEMPLATE,
    }
    text = json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n"
    (out_dir / "tokenizer_config.json").write_text(text, encoding="utf-8")


def perturb_checkpoint(
    source: pathlib.Path, out_dir: pathlib.Path, *, seed: int, scale: float
) -> pathlib.Path:
    """Write `source`'s checkpoint to `out_dir` with every weight matrix nudged by seeded noise
    of relative size `scale`: a stand-in for one training step, same architecture, new weights.
    Norm weights (all ones) are left alone."""
    import shutil  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        if (source / name).exists():
            shutil.copyfile(source / name, out_dir / name)
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(str(source / "model.safetensors"))
    nudged = {
        name: (t + torch.randn(t.shape, generator=generator) * t.std() * scale).contiguous()
        if t.dim() == 2
        else t
        for name, t in tensors.items()
    }
    save_file(nudged, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
