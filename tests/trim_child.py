"""The GPU tests' child process for a trim that invalidates CUDA graphs (tensile.trim_stack,
tensile.trim_blas_workspace): a scheduler captures its step, another graph is captured
beside it, the trim runs, and the old graph must refuse while the scheduler captures again."""
import json
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import json, torch, torchvision, tensile
    from torch import nn
    from tensile import GraphStep, training_step

    def workspace_bytes():
        # what the cuBLAS workspaces hold now (dropping them, at the end of the run)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch._C._cuda_clearCublasWorkspaces()
        return before - torch.cuda.memory_allocated()

    torch.backends.cudnn.benchmark = True
    net = torchvision.models.resnet18(num_classes=10).cuda()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, capturable=True)
    data = [(torch.randn(4, 3, 64, 64, device="cuda"), torch.randint(0, 10, (4,), device="cuda"))
            for _ in range(5)]
    sched = tensile.Scheduler(net, opt, data[0], nn.functional.cross_entropy,
                              allow_cross_iteration=False)
    sched.replay(*data[0]); sched.replay(*data[1])       # an ordinary step, then a capture
    torch.cuda.synchronize()
    old = GraphStep(lambda b, capturing: training_step(net, opt, b, nn.functional.cross_entropy),
                    data[0], net, opt)
    captures = sched.captures
    released = {trim}
    try:
        old(*data[0]); refused = False
    except RuntimeError:
        refused = True
    losses = [float(sched.replay(*b)) for b in data[2:]]
    torch.cuda.synchronize()
    print(json.dumps(dict(released=released, refused=refused, captures=[captures, sched.captures],
                          stale=sched.graph.stale, finite=all(l == l for l in losses),
                          after={after})))
""")


def run_trim_child(trim: str, after: str = "None") -> dict:
    """Run the child with ``trim`` (an expression: the bytes released) and return what it
    printed; ``after``: an expression evaluated at the end (``workspace_bytes()``: what the
    cuBLAS workspaces hold then)."""
    out = subprocess.run([sys.executable, "-c", _SCRIPT.format(trim=trim, after=after)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
