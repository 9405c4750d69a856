"""LoRA adapters (peft) on a small transformers model built from a config: an adapter matrix is rank x
width, so at realistic ranks its states are 8-bit under the default ``min_8bit_size``, an override
by name makes the smaller ones 8-bit too, and a run resumed from its checkpoints steps bit for bit as
the uninterrupted one."""

from __future__ import annotations

import io

import pytest
import torch

from lowbit_compile import QuantizedState, lowbit_compile, memory_report
from lowbit_compile.formats.rounding import SEED as ROUNDING_SEED

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def lora_model(hidden: int, rank: int) -> torch.nn.Module:
    """A two-layer Llama of width ``hidden`` (random weights, no download) with rank-``rank`` adapters on
    every attention and MLP projection; only the adapters train."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(model, lora)
    for name, p in model.named_parameters():  # peft starts B at zero; move it so every step changes A too
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def optimizer(lora: torch.nn.Module, **options) -> torch.optim.Optimizer:
    trainable = [p for p in lora.parameters() if p.requires_grad]  # as the HF Trainer passes them
    return lowbit_compile(torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.0), **options)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 128, (2, 32), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def adapter_formats(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, set[str]]:
    """Each adapter parameter's name -> the formats its exp_avg and exp_avg_sq are held in (not the step
    nor v's stochastic-rounding counter)."""
    names = {p: n for n, p in model.named_parameters()}
    return {names[p]: {v.fmt.name if isinstance(v, QuantizedState) else str(v.dtype)
                       for k, v in state.items() if k not in ("step", ROUNDING_SEED)}
            for p, state in opt.state.items()}


def test_adapters_at_realistic_ranks_keep_8bit_states_under_the_default_threshold(one_thread):
    """rank 16 x width 512: every A (16 x 512) and B (512 x 16, 1024 x 16) holds 8192+ elements, over
    min_8bit_size (4096): ~1 B/param per moment instead of 4, and the frozen base holds none."""
    model = lora_model(hidden=512, rank=16)
    opt = optimizer(model)
    train(model, opt, steps=1)
    formats = adapter_formats(model, opt)
    assert len(formats) == 2 * 7 * 2 and all("lora_" in name for name in formats)
    assert all(f == {"sqrt8"} for f in formats.values()), formats
    per_state = memory_report(opt).per_state
    assert per_state["exp_avg"].bytes_per_param < 1.1 and per_state["exp_avg_sq"].bytes_per_param < 1.1


def test_small_adapters_keep_fp32_states_unless_an_override_names_them(one_thread):
    """rank 4 x width 64 (256 elements): under min_8bit_size, so fp32 (8 B/param: no saving); a name
    pattern makes them 8-bit whatever their size."""
    model = lora_model(hidden=64, rank=4)
    opt = optimizer(model)
    train(model, opt, steps=1)
    assert all(f == {"torch.float32"} for f in adapter_formats(model, opt).values())
    per_state = memory_report(opt).per_state
    assert per_state["exp_avg"].bytes_per_param == per_state["exp_avg_sq"].bytes_per_param == 4.0

    model = lora_model(hidden=64, rank=4)
    opt = optimizer(model, overrides={"*lora_*": "sqrt8"}, model=model)
    train(model, opt, steps=1)
    assert all(f == {"sqrt8"} for f in adapter_formats(model, opt).values())


def test_a_lora_run_resumed_from_its_checkpoints_steps_as_the_uninterrupted_one(one_thread):
    """Save the adapters (peft's state dict) and the optimizer after 3 steps, load both into a new
    model and optimizer (``weights_only``), run 3 more: every adapter weight and state as if never stopped."""
    model = lora_model(hidden=512, rank=16)
    opt = optimizer(model)
    train(model, opt, steps=3)
    buf = io.BytesIO()
    torch.save({"adapters": peft.get_peft_model_state_dict(model), "optimizer": opt.state_dict()}, buf)
    train(model, opt, steps=3, start=3)

    resumed = lora_model(hidden=512, rank=16)  # the base model as before; its adapters as at step 0
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    peft.set_peft_model_state_dict(resumed, saved["adapters"])
    opt2 = optimizer(resumed)
    opt2.load_state_dict(saved["optimizer"])
    train(resumed, opt2, steps=3, start=3)

    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    for s1, s2 in zip(opt.state.values(), opt2.state.values()):
        for key in s1:
            a, b = s1[key], s2[key]
            parts = zip(a.storage_parts, b.storage_parts) if isinstance(a, QuantizedState) else [(a, b)]
            assert all(torch.equal(x, y) for x, y in parts), key
