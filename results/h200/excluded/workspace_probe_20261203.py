"""cuBLAS workspace: how much a captured training step holds, and what a smaller one costs (probe)."""
import os, sys, json, torch
from experiments import models
from experiments.tensile_run import _drop_aux_head, classification_loss
from tensile import GraphStep, training_step
MB = 2**20
out = []
for name in sys.argv[1:]:
    torch.manual_seed(0)
    model = _drop_aux_head(models.build_model(name, num_classes=1000)).train().cuda()
    batch = (models.example_input(name, 2, image_size=224).cuda(), torch.randint(0, 1000, (2,)).cuda())
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, capturable=True)
    training_step(model, opt, batch, classification_loss)
    for cfg in [None, ":1024:1", ":0:0", None, ":1024:1"]:
        if cfg is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = cfg
        torch.cuda.synchronize()
        a0 = torch.cuda.memory_allocated()
        torch._C._cuda_clearCublasWorkspaces()
        a1 = torch.cuda.memory_allocated()
        torch.cuda.empty_cache()
        g = GraphStep(lambda b, capturing: training_step(model, opt, b, classification_loss), batch, model, opt)
        a2 = torch.cuda.memory_allocated()
        ms = g.replay_ms(50, rounds=5, gap_s=0.02)
        row = dict(model=name, cfg=cfg or "default", freed_by_clear_mb=(a0 - a1) / MB, alloc_after_capture_mb=a2 / MB,
                   reserved_mb=torch.cuda.memory_reserved() / MB, peak_mb=g.peak_bytes / MB, replay_ms=ms)
        print(json.dumps(row), flush=True); out.append(row)
        del g
    del model, opt, batch
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "ws_probe.json"), "w"), indent=1)
