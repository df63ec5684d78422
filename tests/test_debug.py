"""Debug dumps and explain(): every promised file, valid against its schema, true to the graph."""

from __future__ import annotations

import json
from importlib import resources

import jsonschema
import pytest
import torch
from matplotlib import pyplot as plt

import fsdp_compile
from fsdp_compile import MfsdpBackend, fully_shard
from fsdp_compile.testing.models import TransformerConfig, make_batch
from fsdp_compile.patterns import count_collectives, is_collective, is_wait
from harness import build_model, compile_one_step, fake_process_group

pytestmark = pytest.mark.structure


def _schema(name: str) -> dict:
    return json.loads(resources.files("fsdp_compile").joinpath(f"schemas/{name}").read_text())


def _dump_step(tmp_path, **options):
    cfg = TransformerConfig()
    with fake_process_group(8):
        graph = compile_one_step(fully_shard(build_model(cfg)), cfg, **options)
    folder = tmp_path / "rank0" / graph.dumper.folder.name if graph.dumper else None
    return graph, folder


def test_dump_folder_holds_every_promised_file(tmp_path):
    graph, folder = _dump_step(tmp_path, debug_dir=str(tmp_path))
    for name in ("README.md", "plan.json", "schedule.json", "timeline.png"):
        assert (folder / name).stat().st_size > 0, name
    passes = sorted(p.name for p in (folder / "passes").iterdir())
    assert passes == [
        "00_dynamo.py",
        "01_drop_block_probes.py",
        "02_dedupe_unshards.py",
        "03_joint.py",
        "04_constant_opaque_outputs.py",
        "05_lower_collectives.py",
        "06_pack_in_reduce_dtype.py",
        "07_reshard.py",
        "08_save_block_rng.py",
        "09_forward.py",
        "10_backward.py",
    ]
    # The repeated block's body, a frame of its own compiled once for all layers, has a folder
    # of its own beside the step's.
    (body,) = set((tmp_path / "rank0").glob("graph_*")) - {folder}
    assert {"plan.json", "passes"} <= {p.name for p in body.iterdir()}
    assert any("reshard" in p.name for p in (body / "passes").iterdir())
    readme = (folder / "README.md").read_text()
    assert all(f in readme for f in ("plan.json", "schedule.json", "timeline.png", "frames/"))
    # The source mapping: graph nodes annotated with the user lines they came from (depyf's
    # decompiled frames beside them).
    assert "models.py" in (folder / "passes" / "00_dynamo.py").read_text()
    frames = list((tmp_path / "rank0" / "frames").glob("*.py"))
    assert any("def forward" in f.read_text() for f in frames)


def test_plan_and_schedule_validate_and_agree_with_the_graph(tmp_path):
    graph, folder = _dump_step(tmp_path, debug_dir=str(tmp_path))
    plan = json.loads((folder / "plan.json").read_text())
    schedule = json.loads((folder / "schedule.json").read_text())
    jsonschema.validate(plan, _schema("plan.schema.json"))
    jsonschema.validate(schedule, _schema("schedule.schema.json"))

    assert [p["fqn"] for p in plan["params"]] == [p.fqn for p in graph.plan.params]
    # A block's parameters are gathered as one flat parameter, which names them.
    members = {m for p in plan["params"] for m in p["members"]}
    assert "layers.0._flat0" in {p["fqn"] for p in plan["params"]}
    assert "layers.0.attn.wqkv.weight" in members and "layers.2.mlp.down.weight" in members
    for role, gm in (("forward", graph.forward), ("backward", graph.backward)):
        listed = [c for c in schedule["collectives"] if c["graph"] == role]
        counts = count_collectives(gm.graph)
        assert len(listed) == counts["all_gather"] + counts["reduce_scatter"]
        nodes = list(gm.graph.nodes)
        for c in listed:
            issued, waited = nodes[c["issue_position"]], nodes[c["wait_position"]]
            assert is_collective(issued) and is_wait(waited) and waited.args[0] is issued
            moved = issued.meta["val"] if c["kind"] == "all_gather" else issued.args[0].meta["val"]
            assert c["bytes"] == moved.numel() * moved.element_size()


def test_timeline_opens_as_an_image(tmp_path):
    _, folder = _dump_step(tmp_path, debug_dir=str(tmp_path))
    image = plt.imread(folder / "timeline.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 500


def test_environment_variable_turns_dumps_on(tmp_path, monkeypatch):
    monkeypatch.setenv("MFSDP_DEBUG_DIR", str(tmp_path))
    _, folder = _dump_step(tmp_path)
    assert (folder / "schedule.json").exists()


def test_explain_summarises_parameters_and_collectives():
    cfg = TransformerConfig()
    with fake_process_group(8):
        model = fully_shard(build_model(cfg))
        tokens, _ = make_batch(cfg, 2, 8, 0)
        summary = fsdp_compile.explain(model, tokens)
    assert summary.managed == len({id(p) for p in model.parameters()})
    assert summary.buckets == 4  # <root> (embedding, positions, final norm: kept gathered), three blocks
    assert summary.collectives["forward all_gather"] == summary.buckets
    assert summary.collectives["backward reduce_scatter"] == summary.buckets
    assert "tied with head.weight" in summary.excluded["embed.weight"]
    assert "frozen" in summary.excluded["pos"]
    assert 0 < summary.exposed_comm_seconds <= summary.step_seconds
    text = str(summary)
    assert "collectives per step" in text and "exposed communication" in text and "buckets: 4" in text


def test_bad_debug_dir_option_is_rejected():
    with pytest.raises(ValueError, match="debug_dir"):
        MfsdpBackend(debug_dir=3)


def test_dumps_without_the_debug_extra_fail_before_tracing(tmp_path, monkeypatch):
    """depyf and matplotlib are the ``[debug]`` extra, not core dependencies: asking for
    dumps without them is one ``ValueError`` naming the install, raised when the backend
    first sees the graph (before the plan's rank check or any collective), not an
    ImportError halfway through the dumps."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "depyf" else real_find_spec(name, *a)
    )
    with pytest.raises(ValueError, match=r"need depyf: pip install 'fsdp_compile\[debug\]'"):
        _dump_step(tmp_path, debug_dir=str(tmp_path))


class _Scale(torch.nn.Module):
    """A model whose frame is not the test Transformer's."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return (x @ self.weight).relu()


def test_two_models_dump_their_frames_each_into_their_own_folder(tmp_path):
    """Each frame goes to the folder of the compile that asked for it. Seen before, when a
    Dynamo bytecode hook (which sees every frame of the process) wrote them: a process that
    compiled three HF models with three ``debug_dir``s wrote the frames of all three into
    every folder."""
    first, second = tmp_path / "transformer", tmp_path / "scale"
    cfg = TransformerConfig()
    with fake_process_group(8):
        compile_one_step(fully_shard(build_model(cfg)), cfg, debug_dir=str(first))
        scale = torch.compile(fully_shard(_Scale()), backend=MfsdpBackend(compiler="eager", debug_dir=str(second)))
        scale(torch.randn(2, 8)).sum().backward()
    frames = {root: {f.name for f in (root / "rank0" / "frames").glob("*.py")} for root in (first, second)}
    scale_frame = f"forward-{_Scale.forward.__code__.co_firstlineno}.py"
    assert frames[second] == {scale_frame}
    assert frames[first] and scale_frame not in frames[first]
