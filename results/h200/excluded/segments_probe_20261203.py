"""Where a captured TENSILE job's reserved memory goes (vs vanilla captured), one process."""
import sys, collections, torch, json
from experiments import models
from experiments.tensile_run import _drop_aux_head, classification_loss
from experiments.tensile_multi import _CapturedVanilla, NUM_CLASSES, LR
from experiments.tensile_run import machine_rates
from tensile import Scheduler, trim_stack
from tensile.resident import install_streamed
from tensile.planner import CAPTURED_SWAP_COST_MS

name, phase = sys.argv[1], sys.argv[2]
mo = float(sys.argv[3]) if len(sys.argv) > 3 else 0.1
so = float(sys.argv[4]) if len(sys.argv) > 4 else 0.02
torch.manual_seed(0)
model = _drop_aux_head(models.build_model(name, num_classes=NUM_CLASSES)).train().cuda()
x = models.example_input(name, 2, image_size=224).cuda()
y = torch.randint(0, NUM_CLASSES, (2,)).cuda()
batch = (x, y)
opt = torch.optim.Adam(model.parameters(), lr=LR, capturable=True)
torch.cuda.memory._record_memory_history(max_entries=200000)
rates = machine_rates("cuda"); torch.cuda.empty_cache()
if phase == "tensile":
    install_streamed(model, opt, batch, classification_loss, groups=16, prefetch=2, resident="auto",
                     max_overhead=so, jobs=1, h2d_bw=rates["h2d_bw"], d2h_bw=rates["d2h_bw"])
    sched = Scheduler(model, opt, batch, classification_loss, allow_cross_iteration=False,
                      swap_cost_ms=CAPTURED_SWAP_COST_MS, max_overhead=mo, **rates)
    step = lambda: sched.replay(*batch)
else:
    step = _CapturedVanilla(model, opt, batch, classification_loss)
for i in range(12):
    step()
    if i == 0:
        print("trim", trim_stack() / 2**20)
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
for i in range(10):
    step()
torch.cuda.synchronize()
MB = 2**20
print(phase, name, "alloc now %.1f peak %.1f reserved %.1f peak %.1f" % (
    torch.cuda.memory_allocated() / MB, torch.cuda.max_memory_allocated() / MB,
    torch.cuda.memory_reserved() / MB, torch.cuda.max_memory_reserved() / MB))
snap = torch.cuda.memory._snapshot()
groups = collections.defaultdict(lambda: [0, 0, 0])
for seg in snap["segments"]:
    k = (str(seg.get("segment_pool_id")), seg["stream"], seg["segment_type"])
    g = groups[k]; g[0] += 1; g[1] += seg["total_size"]; g[2] += seg["allocated_size"]
for k, g in sorted(groups.items(), key=lambda kv: -kv[1][1]):
    print("pool %s stream %s %s: %d segs total %.1f MB alloc %.1f MB" % (*k, g[0], g[1] / MB, g[2] / MB))
# the biggest free blocks and the biggest live blocks, with where they came from
def where(b):
    fr = [f for f in b.get("frames", []) if "site-packages" not in f["filename"] and "/python3" not in f["filename"]]
    return " <- ".join("%s:%d:%s" % (f["filename"].split("/")[-1], f["line"], f["name"]) for f in fr[:4])
blocks = [(b, seg) for seg in snap["segments"] for b in seg["blocks"]]
for state in ("active_allocated", "inactive"):
    bs = sorted([bb for bb in blocks if bb[0]["state"] == state], key=lambda bb: -bb[0]["size"])
    print("==", state, len(bs), "blocks %.1f MB" % (sum(b["size"] for b, _ in bs) / MB))
    for b, seg in bs[:15]:
        print("  %.2f MB pool %s stream %s  %s" % (b["size"] / MB, seg.get("segment_pool_id"), seg["stream"], where(b)))
