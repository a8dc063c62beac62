"""Dense MLP: gated (SwiGLU/GeGLU: gate, up, down) or plain (up, activation, down).

Source: transformers' ``<Family>MLP.forward``: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` or
``down_proj(act_fn(up_proj(x)))``; what each op saves is autograd's (linear: its input; SiLU/GELU:
their input; mul: both operands; ReLU: its output)."""

from __future__ import annotations

from . import Bytes

NAME = "mlp"
CASES = [("llama", dict(hidden_size=64, intermediate_size=96)),
         ("nemotron_h", dict(hidden_size=64, intermediate_size=96, hybrid_override_pattern="*-",
                             num_hidden_layers=2))]


def _act_name(module) -> str:
    act = getattr(module, "act_fn", None) or getattr(module, "act", None) or getattr(module, "activation_fn", None)
    return type(act).__name__ if act is not None else ""


def dims(module) -> dict:
    if hasattr(module, "gate_up_proj"):
        inter, gated = module.gate_up_proj.out_features // 2, True
    elif hasattr(module, "gate_proj"):
        inter, gated = module.gate_proj.out_features, True
    elif hasattr(module, "up_proj"):
        inter, gated = module.up_proj.out_features, False
    elif hasattr(module, "w1") and hasattr(module, "w3"):   # LFM: w2(silu(w1 x) * w3 x)
        inter, gated = module.w1.out_features, True
    elif hasattr(module, "proj_up_gate") or hasattr(module, "proj_up_gate_z"):   # xLSTM
        inter, gated = module.proj_down.in_features, True
    elif hasattr(module, "fc1"):
        inter, gated = module.fc1.out_features, False
    else:
        raise ValueError(f"{type(module).__name__}: no gate_proj / up_proj / fc1 (the memory planner's MLP model)")
    down = next(getattr(module, n) for n in ("down_proj", "fc2", "w2", "proj_down") if hasattr(module, n))
    return {"hidden": down.out_features, "intermediate": inter, "gated": gated, "act": _act_name(module)}


def saved(d: dict, b: int, kernel: str = "torch", P: int = 1, backend: str = "ulysses") -> Bytes:
    h, i = d["hidden"], d["intermediate"]
    out = b * h                                 # the input (the norm's output), saved by the first projection(s)
    if d["gated"]:
        out += 4 * b * i                        # gate (act's input), act(gate), up (the mul's operands), product
    elif "ReLUSquared" in d["act"]:
        out += 2 * b * i                        # relu's output (its own backward and the square's), the square
    else:
        out += 2 * b * i                        # the activation's input and its output (down_proj's input)
    # its backward beyond the saved tensors (as memory_probe.step_peak measures it): the incoming gradient
    # and the one it produces (2 x hidden) and the gradient of the product/activation (one intermediate)
    return Bytes(out, backward=b * i + 2 * b * h,
                 source=f"transformers MLP.forward ({'gated ' if d['gated'] else ''}{d['act']})")
