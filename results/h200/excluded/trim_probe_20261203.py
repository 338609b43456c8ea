"""Which orders of trim_stack and CUDA-graph capture replay correctly (throwaway probe)."""
import json, subprocess, sys

def child(variant, model_name):
    import torch
    import tensile
    from tensile import GraphStep, training_step
    from experiments.models import build_model, example_input
    from experiments.tensile_run import _drop_aux_head, classification_loss
    torch.backends.cudnn.benchmark = True
    out = {"variant": variant, "model": model_name}
    def note(k): out[k] = tensile.stack_reservation().bytes_per_thread
    model = _drop_aux_head(build_model(model_name, num_classes=1000)).train().cuda()
    batch = (example_input(model_name, 2, "cuda"), torch.randint(0, 1000, (2,), device="cuda"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    fn = lambda b, capturing: training_step(model, opt, b, classification_loss)
    training_step(model, opt, batch, classification_loss)
    note("after_eager")
    def replay(g, n=20, key="replay"):
        for _ in range(n): g(*batch)
        torch.cuda.synchronize(); note(key)
    if variant == "capture_trim_replay":
        g = GraphStep(fn, batch, model, opt); replay(g, key="before"); tensile.trim_stack(); note("trimmed"); replay(g)
    elif variant == "capture_trim_eager_replay":
        g = GraphStep(fn, batch, model, opt); replay(g, key="before"); tensile.trim_stack(); note("trimmed")
        training_step(model, opt, batch, classification_loss); torch.cuda.synchronize(); note("eager"); replay(g)
    elif variant == "capture_trim_recapture_replay":
        g = GraphStep(fn, batch, model, opt); replay(g, key="before"); tensile.trim_stack(); note("trimmed")
        del g; g = GraphStep(fn, batch, model, opt); note("recaptured"); replay(g)
    elif variant == "capture_trim_recapture_replay_old":
        g = GraphStep(fn, batch, model, opt); replay(g, key="before"); tensile.trim_stack(); note("trimmed")
        g2 = GraphStep(fn, batch, model, opt); note("recaptured"); replay(g2); replay(g, key="old")
    elif variant == "trim_capture_replay":
        tensile.trim_stack(); note("trimmed"); g = GraphStep(fn, batch, model, opt); note("captured"); replay(g)
        training_step(model, opt, batch, classification_loss); torch.cuda.synchronize(); note("eager"); replay(g, key="replay2")
    elif variant == "trim_capture_replay_trim_replay":
        tensile.trim_stack(); g = GraphStep(fn, batch, model, opt); replay(g, key="before"); tensile.trim_stack(); note("trimmed2"); replay(g)
    elif variant == "capture_trim_restore_replay":   # graph captured at 1024; limit back to 1024 after trim
        g = GraphStep(fn, batch, model, opt); replay(g, key="before"); tensile.trim_stack()
        from tensile.stack import _runtime; import ctypes
        _runtime().cudaDeviceSetLimit(ctypes.c_int(0), ctypes.c_size_t(1024)); note("restored"); replay(g)
    loss = float(g.static_loss); out["loss_finite"] = loss == loss
    print("ROW " + json.dumps(out), flush=True)

if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(sys.argv[1], sys.argv[2]); sys.exit()
    for model in ("resnet50", "densenet121"):
        for v in ("capture_trim_replay", "capture_trim_eager_replay", "capture_trim_recapture_replay",
                  "capture_trim_recapture_replay_old", "trim_capture_replay", "trim_capture_replay_trim_replay",
                  "capture_trim_restore_replay"):
            r = subprocess.run([sys.executable, __file__, v, model], capture_output=True, text=True, timeout=120)
            rows = [l for l in r.stdout.splitlines() if l.startswith("ROW")]
            err = [l for l in r.stderr.splitlines() if "Error" in l][-1:] 
            print(model, v, "rc", r.returncode, rows[-1][4:] if rows else "", err, flush=True)
