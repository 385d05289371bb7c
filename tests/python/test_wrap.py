"""shardkit.wrap: FSDP1's auto-wrap policies, which units they pick, and which parameters each unit owns.

The oracle is torch FSDP1 itself: one world-1 gloo launch (module-scoped, shared by every case) wraps each
model of CASES with torch.distributed.fsdp.FullyShardedDataParallel and the same policy built from
torch.distributed.fsdp.wrap, and reports every FSDP instance's path and its FlatParameter's names. The
tests then call ``shardkit.wrap.choose_units`` / ``assign_parameters`` in-process and compare.

Two deliberate differences from torch, asserted as such (never against torch):
- a module the policy picks that ends up owning no parameter becomes no shardkit unit (torch wraps it in
  an FSDP instance without a FlatParameter, which gathers nothing): both sides list only the units that
  own a parameter (the root too);
- a parameter registered by modules of two units belongs to their closest common unit (torch FSDP1 puts
  it in the first unit wrapped and leaves correctness to the user), see the tied cases at the end.

What it can catch: a policy answering differently from torch's for the same arguments, wrapping order or
nesting other than FSDP1's recursion, miscounted "nonwrapped" numels (shared or ignored parameters),
force_leaf / exclude defaults, parameters left to the wrong unit or counted twice, ignored modules wrapped.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from support import harness
from support.fsdp_cases import Block, Net

# --- models ---------------------------------------------------------------------------------------------

class Shared(nn.Module):
    """Two Linear layers sharing one 10x10 weight (100 elements, registered twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 10, bias=False)
        self.b = nn.Linear(10, 10, bias=False)
        self.b.weight = self.a.weight


class SharedInside(nn.Module):
    """``inner`` holds only the shared weight (100 distinct elements); ``out`` is small."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Shared()
        self.out = nn.Linear(3, 3)


class WithAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2)  # 1,088 elements; out_proj alone 272
        self.proj = nn.Linear(16, 16)  # 272

    def forward(self, x):
        return self.proj(self.attn(x, x, x)[0])


class Outer(nn.Module):
    """Two Blocks inside one more module, the second Block's ``up`` tied to the first's."""

    def __init__(self) -> None:
        super().__init__()
        self.pair = nn.Sequential(Block(), Block())
        self.pair[1].up.weight = self.pair[0].up.weight
        self.head = nn.Linear(16, 4)


def gpt2(tied: bool = True):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                      bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied))


def gpt2_untied():
    return gpt2(tied=False)


def gpt2_block() -> type:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return GPT2Block


# --- cases: (model builder, policy(library), ignored module paths) -------------------------------------
# `policy(lib)` builds the policy from `lib`, which is torch.distributed.fsdp.wrap or shardkit.wrap: the
# same call on both, so the comparison is of the libraries, never of two hand-written policies.

def _size(min_num_params, **kw):
    return lambda lib: functools.partial(lib.size_based_auto_wrap_policy, min_num_params=min_num_params, **kw)


def _transformer(*classes):
    return lambda lib: functools.partial(lib.transformer_auto_wrap_policy,
                                         transformer_layer_cls={c() if c is gpt2_block else c for c in classes})


def _lambda(fn):
    return lambda lib: functools.partial(lib.lambda_auto_wrap_policy, lambda_fn=fn)


def _up_or_block(m):
    return isinstance(m, Block) or (isinstance(m, nn.Linear) and m.out_features == 32)


CASES = {
    "transformer_blocks": (Net, _transformer(Block), ()),
    # torch's spelling of "a set of classes" is ModuleWrapPolicy; shardkit takes the set itself
    "class_set": (Net, lambda lib: lib.ModuleWrapPolicy({Block}) if hasattr(lib, "ModuleWrapPolicy") else {Block}, ()),
    "size_1000_blocks": (Net, _size(1000), ()),
    "size_500_linears": (Net, _size(500), ()),
    "size_3000_modulelist_excluded": (Net, _size(3000), ()),
    "size_3000_exclude_nothing": (Net, _size(3000, exclude_wrap_modules=set()), ()),
    "size_500_block_leaf": (Net, _size(500, force_leaf_modules={Block}), ()),
    "size_huge_root_only": (Net, _size(10**8), ()),
    "size_200_attention_leaf": (WithAttention, _size(200), ()),
    "size_200_attention_not_leaf": (WithAttention, _size(200, force_leaf_modules=set()), ()),
    "size_150_shared_counted_once": (SharedInside, _size(150), ()),
    "lambda_linears_32": (Net, _lambda(lambda m: isinstance(m, nn.Linear) and m.out_features == 32), ()),
    "lambda_nested": (Net, _lambda(_up_or_block), ()),
    "ignored_block": (Net, _transformer(Block), ("blocks.1",)),
    "ignored_size_500": (Net, _size(500), ("blocks.0.up", "head")),
    "gpt2_blocks": (gpt2, _transformer(gpt2_block), ()),
    "gpt2_untied_size_2000": (gpt2_untied, _size(2000), ()),  # tied: see the end of the file
    "no_policy": (Net, lambda lib: None, ()),
}


def _ignored(model: nn.Module, paths) -> list[nn.Module]:
    return [model.get_submodule(p) for p in paths]


# --- the torch FSDP1 oracle -----------------------------------------------------------------------------

def _torch_wrapping(rank: int, world: int, names: list[str]) -> dict[str, list[tuple[str, list[str]]]]:
    """Per case: torch FSDP1's instances that own parameters, as (path, parameter names), in module order."""
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import wrap as torch_wrap

    warnings.filterwarnings("ignore")  # "switching to NO_SHARD since the world size is 1"
    prefix = "_fsdp_wrapped_module."
    out = {}
    for name in names:
        build, policy, ignored = CASES[name]
        model = build()
        wrapped = TorchFSDP(model, process_group=dist.group.WORLD, auto_wrap_policy=policy(torch_wrap),
                            ignored_modules=_ignored(model, ignored), device_id=torch.device("cpu"),
                            use_orig_params=True)
        units = []
        for path, sub in wrapped.named_modules():
            if isinstance(sub, TorchFSDP) and sub._flat_param is not None:
                path = path.replace(prefix, "")
                base = f"{path}." if path else ""
                units.append((path, [base + fqn for fqn in sub._flat_param._fqns]))
        out[name] = units
    return out


@pytest.fixture(scope="module")
def torch_wrapping(tmp_path_factory):
    return harness.run(_torch_wrapping, 1, sorted(CASES), workdir=tmp_path_factory.mktemp("fsdp1"),
                       backend="gloo", timeout=240)[0]


def shardkit_wrapping(name: str) -> list[tuple[str, list[str]]]:
    import shardkit.wrap as sk_wrap

    build, policy, ignored = CASES[name]
    model = build()
    ignored_modules = _ignored(model, ignored)
    ignored_params = {id(p) for m in ignored_modules for p in m.parameters()}
    units = sk_wrap.choose_units(model, sk_wrap.as_policy(policy(sk_wrap)), {id(m) for m in ignored_modules})
    owners = sk_wrap.assign_parameters(model, units, ignored_params)
    return [(path, [fqn for fqn, _ in owners[path]]) for path, _ in units if owners[path]]


# --- tests ----------------------------------------------------------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(CASES))
def test_units_and_parameters_match_torch_fsdp1(torch_wrapping, case):
    got = shardkit_wrapping(case)
    want = torch_wrapping[case]
    assert [p for p, _ in got] == [p for p, _ in want], f"{case}: units differ from torch FSDP1's"
    assert got == want, f"{case}: parameters per unit differ from torch FSDP1's"


def test_expected_units_for_a_few_cases():
    """The oracle's answers spelled out for the plainest cases (so a broken oracle cannot pass silently)."""
    units = {case: [p for p, _ in shardkit_wrapping(case)] for case in
             ("transformer_blocks", "size_500_linears", "size_500_block_leaf", "gpt2_blocks", "no_policy",
              "size_200_attention_leaf", "ignored_block")}
    assert units == {
        "transformer_blocks": ["", "blocks.0", "blocks.1", "blocks.2"],
        "size_500_linears": ["", "blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down", "blocks.2.up",
                             "blocks.2.down"],
        "size_500_block_leaf": [""],  # a force-leaf module is neither looked into nor wrapped (torch's rule)
        "gpt2_blocks": ["", "transformer.h.0", "transformer.h.1"],
        "no_policy": [""],
        "size_200_attention_leaf": ["", "proj"],
        "ignored_block": ["", "blocks.0", "blocks.2"],
    }
    gpt = dict(shardkit_wrapping("gpt2_blocks"))
    assert gpt[""] == ["transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
                       "transformer.ln_f.bias"], "the tied lm_head weight is wte's: one parameter, in the root"


def test_policies_answer_like_torchs():
    """Each policy function, called with the same arguments, returns what torch's returns."""
    from torch.distributed.fsdp import wrap as torch_wrap

    import shardkit.wrap as sk_wrap

    modules = [nn.Linear(4, 4), nn.MultiheadAttention(8, 2), nn.ModuleList([nn.Linear(2, 2)]), Block(), nn.ReLU()]
    variants = [
        ("size_based_auto_wrap_policy", {"min_num_params": 100}),
        ("size_based_auto_wrap_policy", {"min_num_params": 100, "force_leaf_modules": {Block}}),
        ("size_based_auto_wrap_policy", {"min_num_params": 100, "exclude_wrap_modules": set()}),
        ("transformer_auto_wrap_policy", {"transformer_layer_cls": {Block, nn.Linear}}),
        ("lambda_auto_wrap_policy", {"lambda_fn": lambda m: isinstance(m, nn.ReLU)}),
        ("always_wrap_policy", {}),
    ]
    differing = []
    for (fn, kwargs), module, recurse, numel in itertools.product(variants, modules, (True, False), (0, 99, 100)):
        args = dict(module=module, recurse=recurse, nonwrapped_numel=numel, **kwargs)
        want, got = getattr(torch_wrap, fn)(**args), getattr(sk_wrap, fn)(**args)
        if bool(got) != bool(want):
            differing.append(f"{fn}({type(module).__name__}, recurse={recurse}, nonwrapped_numel={numel}, "
                             f"{sorted(kwargs)}): shardkit {got}, torch {want}")
    assert not differing, "\n".join(differing)


def test_policy_defaults_are_torchs():
    from torch.distributed.fsdp import wrap as torch_wrap

    import shardkit.wrap as sk_wrap

    assert sk_wrap.FORCE_LEAF_MODULES == torch_wrap.size_based_auto_wrap_policy.FORCE_LEAF_MODULES
    assert sk_wrap.EXCLUDE_WRAP_MODULES == torch_wrap.size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES


def test_as_policy_refuses_what_is_not_a_policy():
    import shardkit.wrap as sk_wrap

    for bad in ({nn.Linear, int}, "Block", 3):
        with pytest.raises(TypeError) as info:
            sk_wrap.as_policy(bad)
        assert str(info.value) == ("auto_wrap_policy must be a callable policy(module, recurse, nonwrapped_numel) "
                                   f"or a set of nn.Module classes, got {bad!r}")
    for classes in ({Block}, [Block], (Block,), frozenset({Block})):
        policy = sk_wrap.as_policy(classes)
        assert policy(module=Block(), recurse=False, nonwrapped_numel=0) is True
        assert policy(module=nn.Linear(2, 2), recurse=False, nonwrapped_numel=0) is False


# --- shared parameters: owned once, by the closest unit enclosing every module that registers them ------

def _owners(model, policy):
    import shardkit.wrap as sk_wrap

    units = sk_wrap.choose_units(model, policy, set())
    return [p for p, _ in units], {path: [n for n, _ in params]
                                   for path, params in sk_wrap.assign_parameters(model, units, set()).items()}


def test_parameter_tied_across_sibling_units_goes_to_the_root():
    import shardkit.wrap as sk_wrap

    torch.manual_seed(0)
    units, owners = _owners(Net(depth=3, tied=True), functools.partial(sk_wrap.transformer_auto_wrap_policy,
                                                                       transformer_layer_cls={Block}))
    assert units == ["", "blocks.0", "blocks.1", "blocks.2"]
    assert owners == {
        "": ["embed.weight", "blocks.0.up.weight", "head.weight", "head.bias"],
        "blocks.0": ["blocks.0.up.bias", "blocks.0.down.weight", "blocks.0.norm.weight", "blocks.0.norm.bias"],
        "blocks.1": ["blocks.1.up.weight", "blocks.1.up.bias", "blocks.1.down.weight", "blocks.1.norm.weight",
                     "blocks.1.norm.bias"],
        "blocks.2": ["blocks.2.up.bias", "blocks.2.down.weight", "blocks.2.norm.weight", "blocks.2.norm.bias"],
    }


def test_parameter_tied_inside_a_nested_unit_goes_to_that_unit():
    import shardkit.wrap as sk_wrap

    torch.manual_seed(0)
    policy = functools.partial(sk_wrap.lambda_auto_wrap_policy,
                               lambda_fn=lambda m: isinstance(m, (Block, nn.Sequential)))
    units, owners = _owners(Outer(), policy)
    assert units == ["", "pair", "pair.0", "pair.1"]
    assert owners == {
        "": ["head.weight", "head.bias"],
        "pair": ["pair.0.up.weight"],
        "pair.0": ["pair.0.up.bias", "pair.0.down.weight", "pair.0.norm.weight", "pair.0.norm.bias"],
        "pair.1": ["pair.1.up.bias", "pair.1.down.weight", "pair.1.norm.weight", "pair.1.norm.bias"],
    }


def test_parameter_tied_inside_one_unit_stays_there_once():
    import shardkit.wrap as sk_wrap

    units, owners = _owners(SharedInside(), functools.partial(sk_wrap.lambda_auto_wrap_policy,
                                                             lambda_fn=lambda m: isinstance(m, Shared)))
    assert units == ["", "inner"]
    assert owners == {"": ["out.weight", "out.bias"], "inner": ["inner.a.weight"]}


def test_tied_embedding_outside_the_unit_that_holds_it_goes_to_the_root():
    """GPT-2's wte (inside `transformer`) is also lm_head's weight (outside): size-based wrapping makes
    `transformer` a unit, and the tied weight is the root's, not `transformer`'s (torch FSDP1 would put it in
    `transformer` and gather it there only)."""
    import shardkit.wrap as sk_wrap

    model = gpt2()
    units, owners = _owners(model, functools.partial(sk_wrap.size_based_auto_wrap_policy, min_num_params=2000))
    assert units[:2] == ["", "transformer"]
    assert owners[""] == ["transformer.wte.weight"]
    assert "transformer.wte.weight" not in owners["transformer"]
    assert "transformer.wpe.weight" in owners["transformer"]


def test_every_parameter_is_owned_exactly_once():
    """For every case: the owners partition the (deduplicated, non-ignored) parameters."""
    for case, (build, _, ignored) in CASES.items():
        model = build()
        ignored_ids = {id(p) for m in _ignored(model, ignored) for p in m.parameters()}
        want = sorted(n for n, p in model.named_parameters() if id(p) not in ignored_ids)
        got = sorted(n for _, names in shardkit_wrapping(case) for n in names)
        assert got == want, f"{case}: owned parameters {got} vs the model's {want}"
