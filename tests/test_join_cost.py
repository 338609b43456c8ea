"""experiments.join_cost: what a swap's waits cost in a CUDA graph (chain of kernels + copies)."""
import pytest
import torch

from experiments import join_cost
from experiments.join_cost import DELAY, SPACING, ChainSpec


@pytest.mark.parametrize("group", [1, 4, 16])
def test_every_wait_comes_after_its_copy_and_a_group_shares_its_wait_ops(group):
    spec = ChainSpec(kernels=1000, swaps=48, group=group)
    pos = spec.positions()
    assert len(pos) == 48
    half = spec.kernels // 2
    for s, (out, release, copy_in, use) in enumerate(pos):
        assert out + DELAY <= release < half <= copy_in and copy_in + DELAY <= use < spec.kernels
        first = pos[s - s % group]   # a group's swaps wait at one op each way
        assert (release, use) == (first[1], first[3])
    assert len({p[1] for p in pos}) == 48 // group == len({p[3] for p in pos})
    assert [p[0] for p in pos] == [10 + SPACING * s for s in range(48)]


def test_bad_specs_are_refused_with_what_was_expected():
    with pytest.raises(ValueError, match="joins must be one of"):
        ChainSpec(joins="all")
    with pytest.raises(ValueError, match=r"swaps \(10\) must be a multiple of group \(4\)"):
        ChainSpec(swaps=10, group=4)
    with pytest.raises(ValueError, match="200 swaps need more than 1000 kernels"):
        ChainSpec(swaps=200)
    with pytest.raises(ValueError, match="forks must be one of"):
        ChainSpec(forks="never")
    with pytest.raises(ValueError, match="side=inline has no side streams to wait for"):
        ChainSpec(side="inline", joins="use")
    with pytest.raises(ValueError, match="side must be one of"):
        ChainSpec(side="host")
    with pytest.raises(ValueError, match="need kernels >= 40"):
        ChainSpec(kernels=10, swaps=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a host without CUDA")
def test_without_cuda_the_cli_says_so(capsys):
    with pytest.raises(SystemExit):
        join_cost.main(["--forks", "each,never"])
    assert "expected a comma-separated list of ('each', 'once'), got 'each,never'" in capsys.readouterr().err
    with pytest.raises(SystemExit):   # a chain no arguments can make: said before CUDA is asked
        join_cost.main(["--swaps", "200"])
    assert "200 swaps need more than 1000 kernels" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        join_cost.main(["--mib", "0"])
    assert "need kernels >= 40 and dim, nbytes, group >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        join_cost.main(["--iters", "0"])
    assert "--iters and --batch must be >= 1, got 0 and 16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        join_cost.main([])
    assert "no CUDA device is available here" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_replay_brings_every_swapped_tensor_back_and_the_cli_writes_rows(tmp_path):
    spec = ChainSpec(kernels=200, swaps=8, group=4, nbytes=1 << 20)
    graph = join_cost.capture_chain(spec)
    _, _, src, host, back, _ = graph._keep
    for b in back:
        b.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for s, h, b in zip(src, host, back):
        assert torch.equal(h, s.cpu()) and torch.equal(b, s)
    join_cost.main(["--swaps", "8", "--group", "1,4", "--kernels", "200", "--iters", "100",
                    "--mib", "1", "--timed", "0,1", "--forks", "once", "--results", str(tmp_path)])
    import pandas as pd
    rows = pd.read_csv(next(tmp_path.glob("*/join_cost.csv")))
    assert len(rows) == 1 + 2 * (4 + 3)   # no swaps; 8 swaps: none/release/use/both (group 1),
    #                                      waits (group 4), with and without timing events
    both = rows[(rows["joins"] == "both") & (rows["group"] == 1) & ~rows["timed"]].iloc[0]
    assert both["waits"] == 16 and both["gpu"] != "cpu" and both["iters"] == 100
    join_cost.main(["--swaps", "8", "--group", "1", "--kernels", "200", "--iters", "100",
                    "--mib", "0.01", "--side", "kernel,inline", "--results", str(tmp_path)])
    rows = pd.read_csv(next(tmp_path.glob("*/join_cost.csv"))).iloc[15:]
    assert sorted(rows["side"]) == ["copy"] + ["inline"] + ["kernel"] * 4   # 0 swaps: side=copy
    assert set(rows[rows["side"] == "inline"]["joins"]) == {"none"}
    trained = join_cost.measure_training("mobilenet_v2", 2, ["kernel", "inline"], iters=100)
    assert [r["side"] for r in trained] == ["none", "kernel", "inline"]
    assert all(r["median_ms"] > 0 and r["iters"] == 100 for r in trained)
