"""Random-weight EAGLE-1 heads and DeepSeek-V3 MTP layers for the speculation tests, and their
plain-torch references (transformers' own decoder layers on the same weights), which draft
greedily from the target's hidden states computed by transformers."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn


def _randomise(module: nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2)


def make_eagle_head(root: Path, target: Path, seed: int = 0, own_embedding: bool = False,
                    fc_bias: bool = False) -> Path:
    """An EAGLE-1 head as vLLM loads it: config.json (one Llama layer) and fc / layers.0 weights
    (its input_layernorm saved too: the head must ignore it), with the target's dimensions."""
    from transformers import AutoConfig, LlamaForCausalLM
    config = AutoConfig.from_pretrained(str(target))
    config.num_hidden_layers, config.architectures = 1, ["EagleLlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    _randomise(model, seed)
    hidden = config.hidden_size
    fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
    _randomise(fc, seed + 1)
    tensors = {k: v for k, v in model.model.state_dict().items() if k.startswith("layers.")}
    tensors.update({f"fc.{k}": v for k, v in fc.state_dict().items()})
    if own_embedding:
        tensors["embed_tokens.weight"] = model.model.embed_tokens.weight.detach()
    path = root / f"eagle{seed}"
    path.mkdir()
    config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


class EagleReference:
    """The head in plain torch: transformers' LlamaDecoderLayer (input norm the identity) over
    fc(cat(embed(token), h)), logits through the target's LM head."""

    def __init__(self, head_dir: Path, ref):
        from transformers import AutoConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
        config = AutoConfig.from_pretrained(str(head_dir))
        config._attn_implementation = "sdpa"
        weights = load_file(str(head_dir / "model.safetensors"))
        self.layer = LlamaDecoderLayer(config, 0)
        self.layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in weights.items()
                                    if k.startswith("layers.0.")})
        self.layer.input_layernorm = nn.Identity()
        self.rotary = LlamaRotaryEmbedding(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias="fc.bias" in weights)
        self.fc.load_state_dict({k.removeprefix("fc."): v for k, v in weights.items() if k.startswith("fc.")})
        own = weights.get("embed_tokens.weight")
        self.embed = (lambda ids: own[ids]) if own is not None else ref.model.embed_tokens
        self.ref = ref

    def target_hidden(self, tokens: list[int]) -> torch.Tensor:
        """The target's hidden states after its final norm, one row per token."""
        return self.ref.model(torch.tensor([tokens])).last_hidden_state[0]

    def run(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([self.embed(tokens), hidden], dim=-1))[None]
        positions = torch.arange(x.shape[1])[None]
        return self.layer(x, position_ids=positions, position_embeddings=self.rotary(x, positions))[0]

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.ref.lm_head(out)

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int, offset: int = 0) -> list[int]:
        """k greedy drafts to follow tokens, the head's rows starting at target position offset."""
        return draft_greedily(self, tokens, k, offset)


def draft_greedily(head, tokens: list[int], k: int, offset: int) -> list[int]:
    """Row r: the token at offset + r + 1 and the target's hidden state at offset + r; each
    draft row then takes the previous draft and the head's output (recomputed whole: causal)."""
    hidden = head.target_hidden(tokens)[offset:len(tokens) - 1]
    ids = list(tokens[offset + 1:])
    drafts = []
    for _ in range(k):
        out = head.run(torch.tensor(ids), hidden)
        drafts.append(int(head.logits(out[-1]).argmax()))
        ids.append(drafts[-1])
        hidden = torch.cat([hidden, out[-1:]])
    return drafts


def add_mtp_layer(path: Path, seed: int = 0) -> None:
    """Write a random DeepSeek-V3 MTP layer (model.layers.{num_hidden_layers}.*: enorm, hnorm,
    eh_proj, a decoder layer, shared_head.norm/head) next to the checkpoint, which transformers
    drops when it loads the target, and set num_nextn_predict_layers = 1."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer
    config = AutoConfig.from_pretrained(str(path))
    n = config.num_hidden_layers
    layer = DeepseekV3DecoderLayer(config, n)
    _randomise(layer, seed)
    layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    hidden = config.hidden_size
    extra = nn.ModuleDict({"enorm": nn.LayerNorm(hidden, bias=False), "hnorm": nn.LayerNorm(hidden, bias=False),
                           "eh_proj": nn.Linear(2 * hidden, hidden, bias=False)})
    _randomise(extra, seed + 1)
    tensors = {f"model.layers.{n}.{k}": v for k, v in layer.state_dict().items()}
    tensors.update({f"model.layers.{n}.{k}": v for k, v in extra.state_dict().items()})
    head = nn.ModuleDict({"norm": nn.LayerNorm(hidden, bias=False),
                          "head": nn.Linear(hidden, config.vocab_size, bias=False)})
    _randomise(head, seed + 2)
    tensors.update({f"model.layers.{n}.shared_head.{k}": v for k, v in head.state_dict().items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "mtp.safetensors"))
    raw = json.loads((path / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(raw, indent=2))


class MtpReference:
    """The MTP layer in plain torch: transformers' DeepseekV3DecoderLayer over
    eh_proj(cat(enorm(embed(token)), hnorm(h))), h before the target's final norm; logits
    through shared_head's norm and head."""

    def __init__(self, path: Path, ref):
        from transformers import AutoConfig
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer,
            DeepseekV3RMSNorm,
            DeepseekV3RotaryEmbedding,
        )
        config = AutoConfig.from_pretrained(str(path))
        config._attn_implementation = "sdpa"
        n = config.num_hidden_layers
        weights = {k.removeprefix(f"model.layers.{n}."): v
                   for k, v in load_file(str(path / "mtp.safetensors")).items()}
        self.layer = DeepseekV3DecoderLayer(config, n)
        self.layer.load_state_dict({k: v for k, v in weights.items() if k.split(".")[0] in
                                    ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")})
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.norms = {}
        for name in ("enorm", "hnorm", "shared_head.norm"):
            norm = DeepseekV3RMSNorm(hidden, eps)
            norm.weight.data.copy_(weights[f"{name}.weight"])
            self.norms[name] = norm
        self.eh_proj, self.head = weights["eh_proj.weight"], weights["shared_head.head.weight"]
        self.rotary = DeepseekV3RotaryEmbedding(config)
        self.ref = ref

    def target_hidden(self, tokens: list[int]) -> torch.Tensor:
        """The target's hidden states before its final norm (its input, caught by a hook)."""
        seen = []
        hook = self.ref.model.norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
        try:
            self.ref.model(torch.tensor([tokens]))
        finally:
            hook.remove()
        return seen[0][0]

    def run(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        embed = self.norms["enorm"](self.ref.model.embed_tokens(tokens))
        x = (torch.cat([embed, self.norms["hnorm"](hidden)], dim=-1) @ self.eh_proj.T)[None]
        positions = torch.arange(x.shape[1])[None]
        return self.layer(x, position_ids=positions, position_embeddings=self.rotary(x, positions))[0]

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.norms["shared_head.norm"](out) @ self.head.T

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int, offset: int = 0) -> list[int]:
        return draft_greedily(self, tokens, k, offset)


def make_markov_target_and_copy_head(root: Path) -> tuple[Path, Path]:
    """A one-layer Llama target whose attention output is zero (o_proj = 0) and whose final norm
    has unit weights, so its next token depends on the last token alone; and an EAGLE head that
    is a copy of its layer with fc passing the token's embedding through: the head's argmax is
    the target's (the final norm only rescales), so every draft is accepted."""
    from transformers import AutoModelForCausalLM

    from pdserve.testing.model_factory import make_model
    target = make_model(root, "llama", seed=4, num_hidden_layers=1)
    model = AutoModelForCausalLM.from_pretrained(str(target))
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
    model.save_pretrained(target)
    hidden = model.config.hidden_size
    tensors = {k: v.clone() for k, v in model.model.state_dict().items() if k.startswith("layers.0.")}
    tensors["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    head = root / "copy_head"
    head.mkdir()
    model.config.architectures = ["LlamaForCausalLMEagle"]
    model.config.save_pretrained(head)
    save_file(tensors, str(head / "model.safetensors"))
    return target, head


def record_drafts(llm) -> list[tuple[str, list[int], list[int], int]]:
    """Every (request id, its tokens, the drafts, the head's offset) the proposer produces."""
    proposer, seen = llm.engine.speculator.proposer, []
    propose = proposer.propose_batch

    def recording(wanted):
        drafts = propose(wanted)
        for (req, _), draft in zip(wanted, drafts):
            if draft:
                seen.append((req.request_id, list(req.all_token_ids), draft, proposer.offsets[req.request_id]))
        return drafts
    proposer.propose_batch = recording
    return seen


def assert_outputs_equal_transformers(ref, prompts: list[list[int]], outs, new_tokens: int) -> None:
    """Each engine output's tokens equal transformers' greedy generate of its prompt."""
    for prompt, out in zip(prompts, outs):
        theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)[0, len(prompt):]
        assert out.outputs[0].token_ids == theirs.tolist()
