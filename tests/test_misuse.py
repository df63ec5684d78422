"""The misuse catalogue (docs/misuse.md): mistakes not covered in test_errors.py and
test_cuda_graph_check.py. Each raises one ValueError naming the fix, before any collective.
Tests are in the structure tier unless marked multirank."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_compile import MfsdpBackend, MixedPrecision, UsageError, fully_shard, shard_info
from fsdp_compile.capture import _copy_into
from harness import fake_process_group, one_rank_group, spawn


@pytest.mark.structure
def test_optimizer_built_before_fully_shard():
    """It would hold the replaced tensors and silently update nothing."""
    with fake_process_group(2):
        model = nn.Linear(4, 4)
        opt = torch.optim.AdamW(model.parameters())
        fully_shard(model)
        model(torch.randn(2, 4)).sum().backward()
        with pytest.raises(ValueError, match="built before fully_shard"):
            opt.step()


@pytest.mark.structure
def test_optimizer_built_after_fully_shard_is_fine():
    with fake_process_group(2):
        model = fully_shard(nn.Linear(4, 4))
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 4)).sum().backward()
        opt.step()


@pytest.mark.structure
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_parameter_replaced_after_sharding(compiled):
    with fake_process_group(2):
        model = fully_shard(nn.Sequential(nn.Linear(4, 4)))
        model[0].weight = nn.Parameter(torch.randn(5, 4))
        forward = torch.compile(model, backend=MfsdpBackend(compiler="eager")) if compiled else model
        with pytest.raises(ValueError, match="replaced after fully_shard"):
            forward(torch.randn(2, 4))


@pytest.mark.structure
def test_zero_dim_parameter():
    model = nn.Linear(4, 4)
    model.scale = nn.Parameter(torch.tensor(1.0))
    with fake_process_group(2):
        with pytest.raises(ValueError, match="shape \\[1\\]"):
            fully_shard(model)


@pytest.mark.structure
def test_three_dimensional_mesh():
    with fake_process_group(8):
        mesh = init_device_mesh("cpu", (2, 2, 2))
        with pytest.raises(ValueError, match="1-D mesh .* or a 2-D mesh"):
            fully_shard(nn.Linear(4, 4), mesh=mesh)


@pytest.mark.structure
def test_unknown_strategy():
    with fake_process_group(2):
        with pytest.raises(ValueError, match="unknown strategy 'zero3'.*optim_grads_params"):
            fully_shard(nn.Linear(4, 4), strategy="zero3")


@pytest.mark.structure
def test_reshard_with_a_strategy_that_keeps_parameters_gathered():
    with fake_process_group(2):
        with pytest.raises(ValueError, match="reshard_after_forward=True contradicts"):
            fully_shard(nn.Linear(4, 4), strategy="optim_grads", reshard_after_forward=True)


@pytest.mark.structure
def test_no_shard_on_a_2d_mesh():
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2))
        with pytest.raises(ValueError, match="no_shard.*1-D mesh"):
            fully_shard(nn.Linear(4, 4), mesh=mesh, strategy="no_shard")


@pytest.mark.structure
def test_gradient_sync_flag_that_is_not_a_bool():
    with fake_process_group(2):
        model = fully_shard(nn.Linear(4, 4))
        with pytest.raises(ValueError, match="True or False"):
            model.set_requires_gradient_sync(0)


@pytest.mark.structure
def test_fsdp2_s_module_methods_work_or_say_what_to_call_instead():
    """A script moving from FSDP2 calls FSDPModule's methods on the model: each of torch's does
    what it means here or raises naming the fix, never nn.Module's bare AttributeError; a
    model's own attribute of such a name (a method, a child module) stays the model's."""
    from torch.distributed.fsdp import FSDPModule

    from fsdp_compile.fsdp2_methods import MESSAGES
    from fsdp_compile.records import gathered_params

    class OwnNames(nn.Linear):
        def __init__(self):
            super().__init__(4, 4)
            self.reshard = nn.Linear(4, 4)

        def unshard(self):
            return "the model's own"

    accepted = {"set_requires_gradient_sync", "set_is_last_backward", "set_unshard_in_backward", "reset_iter_state"}
    with fake_process_group(2):
        model = fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
        public = [n for n in vars(FSDPModule) if not n.startswith("_") and callable(getattr(FSDPModule, n))]
        assert set(public) <= accepted | set(MESSAGES), "a method torch's FSDPModule gained: say it in MESSAGES"
        for name in set(public) - accepted:
            with pytest.raises(UsageError, match=rf"{name}\(\) is a method of torch's FSDP2.*: \w"):
                getattr(model, name)()
        (param, *_) = gathered_params(model)  # a flat parameter, gathered for both linears
        model.set_requires_gradient_sync(False, recurse=True)
        assert "accumulator" in shard_info(param).accumulation
        model.set_requires_gradient_sync(True)
        assert "accumulator" not in shard_info(param).accumulation
        with pytest.raises(UsageError, match="recurse=False"):
            model.set_requires_gradient_sync(False, recurse=False)
        model.set_is_last_backward(False)
        model.set_unshard_in_backward(False)
        assert shard_info(param).accumulation == {}
        for name in ("set_is_last_backward", "set_unshard_in_backward"):
            with pytest.raises(UsageError, match=f"{name} takes True or False"):
                getattr(model, name)(1)
        own = fully_shard(OwnNames())
        assert own.unshard() == "the model's own" and isinstance(own.reshard, nn.Linear)


@pytest.mark.structure
def test_mp_policy_of_the_wrong_type():
    with fake_process_group(2):
        with pytest.raises(ValueError, match="fsdp_compile.MixedPrecision"):
            fully_shard(nn.Linear(4, 4), mp_policy={"param_dtype": torch.bfloat16})


@pytest.mark.structure
@pytest.mark.parametrize(
    "options, message",
    [
        ({"compiler": "aot_eager"}, "'inductor' or 'eager'"),
        ({"cuda_graph": "yes"}, "True or False"),
        ({"mode": "fast"}, r"mode must be one of \['default', .*'max-autotune'"),
        ({"mode": "max-autotune-no-cudagraphs", "compiler": "eager"}, "compiles nothing with Inductor: drop one"),
    ],
)
def test_bad_backend_option_values(options, message):
    with pytest.raises(ValueError, match=message):
        MfsdpBackend(**options)


@pytest.mark.structure
@pytest.mark.parametrize("given", [{"mode": "max-autotune"}, {"options": {"prefetch": 2}}], ids=["mode", "options"])
def test_torch_compile_s_mode_or_options_beside_a_backend_object_name_the_fix(given):
    """torch.compile hands a backend object its ``mode`` or ``options`` as keywords: before,
    "MfsdpBackend.__call__() got an unexpected keyword argument", inside Dynamo's
    BackendCompilerFailed."""
    with fake_process_group(2):
        model = torch.compile(fully_shard(nn.Linear(4, 4)), backend=MfsdpBackend(compiler="eager"), **given)
        with pytest.raises(ValueError, match=rf"passed {next(iter(given))} to an MfsdpBackend object.*MfsdpBackend\(mode=\.\.\., \*\*options\)"):
            model(torch.randn(2, 4))


@pytest.mark.structure
def test_captured_step_called_with_another_shape():
    with pytest.raises(ValueError, match="capture once per shape"):
        _copy_into(torch.zeros(2, 8), torch.zeros(3, 8))


@pytest.mark.structure
@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype"])
@pytest.mark.parametrize(
    "dtype",
    [
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
        torch.float8_e8m0fnu,
        torch.float4_e2m1fn_x2,
    ],
    ids=str,
)
def test_mixed_precision_narrower_than_16_bits(field, dtype):
    """Accepted, it failed inside the compiled step's all-gather, after the collective was
    issued (gloo: "Invalid scalar type")."""
    with pytest.raises(ValueError, match="torchao.*enable_fsdp_float8_all_gather=True.*torch.bfloat16"):
        MixedPrecision(**{field: dtype})


@pytest.mark.structure
def test_fully_shard_on_a_submodule_after_its_root():
    """The root's call already owns the submodule's parameters: the later call did nothing,
    silently, where the user meant a unit of its own."""
    with fake_process_group(2):
        model = fully_shard(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
        with pytest.raises(ValueError, match="'weight' .*Call fully_shard on submodules first, then on the root"):
            fully_shard(model[0])


@pytest.mark.structure
@pytest.mark.parametrize("where", ["root", "block"])
def test_a_model_torch_s_fsdp2_sharded(where):
    """Its parameters are DTensors on the data-parallel mesh already (torch's fully_shard, or
    transformers' DistributedConfig, which applies it): not tensor-parallel pieces."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    with fake_process_group(2):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        torch_fully_shard(model if where == "root" else model[1])
        with pytest.raises(ValueError, match="sharded by torch's FSDP2.*build the model without FSDP2"):
            fully_shard(model)


@pytest.mark.structure
def test_units_whose_parameters_are_already_sharded_are_accepted():
    """Submodules first, then the root: a module whose only parameter is tied to one an earlier
    sibling call sharded, and a root holding only its units' parameters, are no such mistake."""
    with fake_process_group(2):
        embed, head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
        head.weight = embed.weight
        model = nn.Sequential(embed, head)
        fully_shard(embed)
        fully_shard(head)
        fully_shard(model)
        assert head._parameters["weight"] is embed._parameters["weight"]
        assert shard_info(embed._parameters["weight"]).unit.startswith("Embedding#")


def _shard_over_a_mesh_of_rank_0(rank, world):
    try:
        fully_shard(nn.Linear(4, 4), mesh=DeviceMesh("cpu", [0]))
    except UsageError as error:
        return str(error)
    return "no error"


@pytest.mark.multirank
def test_mesh_without_every_rank():
    """Rank 1, outside the mesh, failed in DeviceMesh.get_group (IndexError) and rank 0 went on
    to train alone: both refuse it, without communicating, so neither waits for the other."""
    inside, outside = spawn(_shard_over_a_mesh_of_rank_0, 2, timeout=120)
    assert "holds ranks [0], 1 of the job's 2" in inside, inside
    assert "rank 1 is not in the mesh" in outside, outside
    for message in (inside, outside):
        assert "init_device_mesh('cpu', (2,))" in message, message


@pytest.mark.structure
def test_a_dimension_of_a_mesh_over_every_rank_is_accepted():
    """mesh["dp"] of a (dp, tp) mesh holds some ranks, and every rank is in one such mesh."""
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = fully_shard(nn.Linear(4, 4), mesh=mesh["dp"])
        assert shard_info(model._parameters["weight"]).world == 2


def _meta_model_in_units():
    """Built on the meta device and sharded as docs/user_guide.md shows, blocks first."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for block in model:
        fully_shard(block)
    return fully_shard(model)


@pytest.mark.structure
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_meta_model_never_materialised(compiled):
    """Its first op failed on two devices (compiled: Dynamo's "found at least two devices, cpu
    and meta!"), with no word of to_empty. Materialised after the refusal, the model's next
    eager forward reads gathered weights, a hook's reads too (after a compile, torch's
    to_empty cannot swap the parameters Dynamo keeps weak references to)."""
    with fake_process_group(2):
        model = _meta_model_in_units()
        forward = torch.compile(model, backend=MfsdpBackend(compiler="eager")) if compiled else model
        with pytest.raises(ValueError, match=r"still on the meta device.*model\.to_empty\(device='cpu'\)"):
            forward(torch.randn(2, 4))
        if not compiled:
            model.to_empty(device="cpu")
            read = {}
            model.register_forward_pre_hook(lambda module, args: read.setdefault("weight", module[0].weight))
            forward(torch.randn(2, 4))
            assert type(read["weight"]) is torch.Tensor, type(read["weight"])


@pytest.mark.structure
def test_meta_model_on_meta_inputs_is_no_mistake():
    """A step on meta inputs is what fsdp_compile.simulate traces (compiled: test_simulate.py)."""
    with fake_process_group(2):
        assert _meta_model_in_units()(torch.randn(2, 4, device="meta")).is_meta


class _Scaled(nn.Module):
    """A linear whose output is scaled by a non-persistent buffer, as HF's rotary embedding
    reads ``inv_freq``: in no state dict, so no load fills it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 4), persistent=False)

    def forward(self, x):
        return self.linear(x) * self.scale


def _forward_of(model, api: str):
    backend = MfsdpBackend(compiler="eager")
    if api == "compiled":
        return torch.compile(model, backend=backend)
    if api == "train_step":
        return torch.compile(lambda x: model(x), backend=backend)
    return model


@pytest.mark.structure
@pytest.mark.parametrize("api", ["eager", "compiled", "train_step"])
@pytest.mark.parametrize("left", ["to_empty", "cast_after_to_empty", "loaded_on_meta"])
def test_a_non_persistent_buffer_a_meta_init_leaves_unfilled_is_refused_with_the_fix(left, api):
    """Before: the model ran on what to_empty's memory held (HF Llama's ``inv_freq``: 9.7e32
    and zeros seen on the CPU, under FSDP2 too), or, loaded on meta, failed inside the first
    forward after its collectives had started. Filled as the message says (in place, or
    replaced as torchtitan does), the step computes the unsharded model's output."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    torch.manual_seed(0)
    reference = nn.Sequential(_Scaled(), _Scaled())
    with one_rank_group():
        with torch.device("meta"):
            model = nn.Sequential(_Scaled(), _Scaled())
        for block in model:
            fully_shard(block)
        fully_shard(model)
        if left == "loaded_on_meta":
            set_model_state_dict(model, reference.state_dict(), options=StateDictOptions(full_state_dict=True))
        else:
            model.to_empty(device="cpu")
            if left == "cast_after_to_empty":
                model.double().float()  # a cast of unfilled memory is still unfilled
            set_model_state_dict(model, reference.state_dict(), options=StateDictOptions(full_state_dict=True))
        forward = _forward_of(model, api)
        x = torch.randn(2, 4)
        how = "are still on the meta device" if left == "loaded_on_meta" else "were materialised by to_empty"
        with pytest.raises(ValueError, match=rf"buffers of this Sequential 0\.scale, 1\.scale {how}.*model\.to_empty\(device=\.\.\.\), then model\.init_weights\(\).*then load"):
            forward(x)
        with torch.no_grad():
            model[0].scale = reference[0].scale.clone()  # replaced, as torchtitan builds freqs_cis
            if left == "loaded_on_meta":
                model[1].scale = reference[1].scale.clone()
            else:
                model[1].scale.copy_(reference[1].scale)  # written in place, as HF's init.copy_
        if api == "train_step":  # Dynamo runs a frame that raised in Python from then on
            forward = _forward_of(model, api)
        torch.testing.assert_close(forward(x), reference(x), rtol=0, atol=0)


@pytest.mark.structure
def test_fsdp2_s_integer_reshard_after_forward_means_what_it_means_under_fsdp2():
    """FSDP2's ``reshard_after_forward`` as an int, the group size to reshard to after
    forward: 1 keeps the gathered parameters (False) and the shard group's size frees them
    (True), as FSDP2 takes them (before, 1 was taken as True); a size in between, or 0, is
    refused naming True or False."""
    with fake_process_group(4):
        for size, kept in ((1, True), (4, False)):
            layer = fully_shard(nn.Linear(4, 4), reshard_after_forward=size)
            assert shard_info(layer.weight).reshard_after_forward is not kept, size
        for size in (0, 2):
            with pytest.raises(ValueError, match=f"reshard_after_forward={size}: FSDP2 reshards to groups of {size}.*Pass True or False"):
                fully_shard(nn.Linear(4, 4), reshard_after_forward=size)


@pytest.mark.structure
def test_a_group_of_modules_holding_a_mistake_is_refused_before_any_is_sharded():
    """FSDP2's grouping, ``fully_shard([a, b])``: a list that is empty or holds what is not a
    module is refused naming what is taken; a group with a module sharded before is refused
    before the others are sharded, so the model is as it was."""
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    with fake_process_group(2):
        for group in ([], [first, "second"]):
            with pytest.raises(ValueError, match="fully_shard expects an nn.Module or a non-empty list of them"):
                fully_shard(group)
        fully_shard(second)
        with pytest.raises(ValueError, match="fully_shard was already called on this Linear"):
            fully_shard([first, second])
    assert not isinstance(first.weight, torch.distributed.tensor.DTensor)


@pytest.mark.structure
@pytest.mark.parametrize(
    "option, message",
    [
        ("offload_policy", r"offload_policy=CPUOffloadPolicy\(\.\.\.\): fsdp_compile does not offload.*Drop"),
        ("shard_placement_fn", r"shard_placement_fn places weight: S\(1\).*every parameter on dim 0"),
        ("ignored_params", r"ignored_params: fsdp_compile manages every parameter.*Drop ignored_params"),
    ],
)
def test_fsdp2_options_without_a_counterpart_are_refused_naming_the_fix(option, message):
    """FSDP2's ``fully_shard`` options a migrating user passes: each asking for what mfsdp does
    not do is refused, before any collective, naming the fix (before: Python's "unexpected
    keyword argument"); each asking for what it does anyway is taken."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
    from torch.distributed.tensor import Shard

    layer = nn.Linear(4, 4)
    refused = {
        "offload_policy": CPUOffloadPolicy(),
        "shard_placement_fn": lambda param: Shard(param.ndim - 1),
        "ignored_params": {layer.weight},
    }
    taken = {"offload_policy": OffloadPolicy(), "shard_placement_fn": lambda param: Shard(0), "ignored_params": set()}
    with fake_process_group(2):
        with pytest.raises(ValueError, match=message):
            fully_shard(layer, **{option: refused[option]})
        fully_shard(layer, **{option: taken[option]})
    assert isinstance(layer.weight, torch.distributed.tensor.DTensor)
