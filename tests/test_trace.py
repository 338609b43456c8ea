"""Task-graph trace: nodes, storage edges (RAW/WAR/WAW through views), phases, errors."""
import pytest
import timm
import torch
import torchvision
from torch import nn

from nimble.graph import TaskGraph
from nimble.trace import TraceMismatchError, check_same_ops, trace_graph


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(3, 4, 1)
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        y = torch.cat([self.a(x), self.b(x)], 1)
        return self.fc(y.mean((2, 3)))


def names(g):
    return [n.name for n in g.nodes]


def test_branches_are_independent_and_join_at_cat():
    g = trace_graph(Branchy(), torch.randn(1, 3, 8, 8))
    conv = [n.index for n in g.nodes if n.name == "aten.convolution.default"]
    cat = next(n.index for n in g.nodes if n.name == "aten.cat.default")
    assert len(conv) == 2
    assert (conv[0], conv[1]) not in g.edges          # two branches: no dependency
    assert (conv[0], cat) in g.edges and (conv[1], cat) in g.edges
    assert all(u < v for u, v in g.edges)
    node = g.nodes[conv[0]]
    assert node.flops == 2 * 1 * 4 * 8 * 8 * 3 * 3 * 3      # multiply-adds x 2 from the registry
    assert node.output_shapes == [(1, 4, 8, 8)] and node.input_dtypes[0] == "float32"
    assert node.bytes_written == 4 * 8 * 8 * 4


def test_in_place_and_views_give_war_and_waw_edges():
    class InPlace(nn.Module):
        def forward(self, x):
            y = x * 2                 # op0 writes y
            z = y + 1                 # op1 reads y
            v = y.view(-1)[:4]        # views: no nodes
            v.mul_(3)                 # op2 writes y's storage through a view: WAR on op1, WAW on op0
            return z, y.sum()         # op3 reads y: RAW on op2
    g = trace_graph(InPlace(), torch.randn(4, 4))
    assert names(g) == ["aten.mul.Tensor", "aten.add.Tensor", "aten.mul_.Tensor", "aten.sum.default"]
    assert {(0, 1), (1, 2), (0, 2), (2, 3)} <= set(g.edges)
    assert g.num_view_ops >= 2
    assert g.nodes[2].writes == g.nodes[0].writes        # same storage through the view


@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_writes_its_running_statistics_only_in_training(training):
    """``native_batch_norm``'s schema does not mark them written; the trace must."""
    bn = nn.BatchNorm2d(3).train(training)
    g = trace_graph(nn.Sequential(nn.Conv2d(3, 3, 1), bn), torch.randn(2, 3, 4, 4))
    node = next(n for n in g.nodes if "batch_norm" in n.name)
    stats = [sid for sid in node.reads if sid in g.params and sid not in g.nodes[0].reads]
    assert len(stats) == 4      # weight, bias, running mean, running variance
    written = set(node.writes) & set(stats)
    assert len(written) == (2 if training else 0)


def test_outputs_inputs_and_params_are_named():
    m = Branchy()
    x = torch.randn(1, 3, 8, 8)
    g = trace_graph(m, x)
    assert len(g.inputs) == 1 and len(g.params) == len(list(m.parameters()))
    assert g.outputs and g.outputs[0] in g.nodes[-1].writes
    assert g.nodes[0].reads[0] in g.inputs or g.nodes[0].reads[1] in g.inputs


def test_training_trace_records_backward_and_optimizer_and_restores_state():
    m = torchvision.models.resnet18(num_classes=10)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    g = trace_graph(m, torch.randn(2, 3, 32, 32), training=True, optimizer=opt)
    phases = {n.phase for n in g.nodes}
    assert phases == {"forward", "loss", "backward", "optimizer"}
    assert any("convolution_backward" in n.name for n in g.nodes if n.phase == "backward")
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert all(p.grad is None for p in m.parameters())
    assert opt.state_dict()["state"] == {}
    # backward ops depend on forward ops (saved activations)
    first_bwd = min(n.index for n in g.nodes if n.phase == "backward")
    assert any(u < first_bwd <= v for u, v in g.edges)


def test_data_dependent_model_is_reported_with_first_differing_op():
    class Flaky(nn.Module):
        calls = 0

        def forward(self, x):
            Flaky.calls += 1
            x = x + 1
            return x.relu() if Flaky.calls % 2 else x.sigmoid()
    with pytest.raises(TraceMismatchError, match=r"op #1: expected aten.relu.default\(2x2\), "
                                                 r"got aten.sigmoid.default\(2x2\)"):
        trace_graph(Flaky(), torch.randn(2, 2), check_static=True)


def test_shape_change_is_a_mismatch_too():
    g1 = trace_graph(nn.ReLU(), torch.randn(2, 2))
    g2 = trace_graph(nn.ReLU(), torch.randn(3, 2))
    with pytest.raises(TraceMismatchError, match="op #0"):
        check_same_ops(g1, g2)


def test_host_sync_is_flagged():
    class Syncs(nn.Module):
        def forward(self, x):
            return x * x.sum().item()
    g = trace_graph(Syncs(), torch.randn(3))
    assert any(n.host_sync for n in g.nodes)
    assert not any(n.host_sync for n in trace_graph(Branchy(), torch.randn(1, 3, 8, 8)).nodes)


def test_bad_inputs_get_clear_errors():
    with pytest.raises(TypeError, match="tensor or a tuple of tensors"):
        trace_graph(nn.ReLU(), [torch.randn(2), "x"])
    with pytest.raises(TypeError, match="torch.nn.Module"):
        trace_graph(lambda x: x, torch.randn(2))


@pytest.mark.parametrize("build", [
    lambda: torchvision.models.googlenet(aux_logits=False, init_weights=True),
    lambda: timm.create_model("efficientnet_b0", pretrained=False),
])
def test_torchvision_and_timm_models_trace(build):
    m = build().eval()
    g = trace_graph(m, torch.randn(1, 3, 64, 64), check_static=True)
    assert g.num_nodes > 50 and len(g.edges) >= g.num_nodes - 1
    assert g.total_flops() > 0


def test_save_load_roundtrip(tmp_path):
    g = trace_graph(Branchy(), torch.randn(1, 3, 8, 8))
    g.save(tmp_path / "g.json")
    h = TaskGraph.load(tmp_path / "g.json")
    assert h == g
