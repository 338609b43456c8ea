"""What a training process holds on the GPU outside PyTorch's allocator, by stage, and
whether the context's local-memory (stack) reservation is part of it and can be trimmed."""
import ctypes, json, os, subprocess, sys, time

def nvml_used():
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    return pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20

def child(model_name, bench, trim):
    import torch
    rows = []
    idle = nvml_used()
    cu = ctypes.CDLL("libcuda.so.1")
    def limit(which=0):
        v = ctypes.c_size_t()
        r = cu.cuCtxGetLimit(ctypes.byref(v), ctypes.c_int(which))
        return v.value if r == 0 else f"err{r}"
    def setlimit(which, val):
        return cu.cuCtxSetLimit(ctypes.c_int(which), ctypes.c_size_t(val))
    def note(stage):
        torch.cuda.synchronize()
        used = nvml_used() - idle
        res = torch.cuda.memory_reserved() / 2**20
        rows.append(dict(stage=stage, used_above_idle=round(used, 1), reserved=round(res, 1),
                         outside=round(used - res, 1), stack=limit(0), heap=limit(2), fifo=limit(1)))
        print("ROW", model_name, json.dumps(rows[-1]), flush=True)
    torch.backends.cudnn.benchmark = bench
    torch.zeros(1, device="cuda"); note("context")
    a = torch.randn(256, 256, device="cuda"); (a @ a).sum().item(); note("after matmul")
    c = torch.nn.Conv2d(3, 8, 3).cuda(); c(torch.randn(1, 3, 32, 32, device="cuda")).sum().item(); note("after conv")
    if model_name == "inception_v4":
        import timm; m = timm.create_model("inception_v4", num_classes=1000).cuda()
    else:
        import torchvision; m = getattr(torchvision.models, model_name)(num_classes=1000).cuda()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3, capturable=trim)
    x = torch.randn(2, 3, 224, 224, device="cuda"); y = torch.randint(0, 1000, (2,), device="cuda")
    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(m(x), y).backward(); opt.step()
    def timed(n=20):
        for _ in range(3): step()
        torch.cuda.synchronize(); t=time.perf_counter()
        for _ in range(n): step()
        torch.cuda.synchronize(); return round((time.perf_counter()-t)/n*1e3, 2)
    step(); note("after 1 step")
    for _ in range(4): step()
    note("after 5 steps")
    torch.cuda.empty_cache(); note("empty_cache")
    if trim:
        for v in (1024, 0):
            r = setlimit(0, v); note(f"set stack {v} rc={r}")
        for _ in range(3): step()
        note("after 3 more steps")
        ms0 = timed(); r = setlimit(0, 1024); ms1 = timed(); setlimit(0, 0); ms2 = timed()
        print("ROW", model_name, "eager step ms: stack0", ms0, "stack1024", ms1, "stack0 again", ms2, flush=True)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2): step()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            step()
        for _ in range(5): g.replay()
        note("captured step x5")
        r = setlimit(0, 0); note(f"set stack 0 after graph rc={r}")
        for _ in range(5): g.replay()
        note("replay x5 after trim")
    print("ROWS " + json.dumps(dict(model=model_name, bench=bench, lazy=os.environ.get("CUDA_MODULE_LOADING"), rows=rows)))

if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"); sys.exit()
    import torch
    p = torch.cuda.get_device_properties(0)
    print("SMs", p.multi_processor_count, "max threads/SM", getattr(p, "max_threads_per_multi_processor", None), "torch", torch.__version__, "cudnn", torch.backends.cudnn.version())
    for model, bench, trim in [("resnet50", 1, 1), ("inception_v4", 1, 1), ("densenet121", 1, 1), ("vgg16", 1, 1), ("inception_v3", 1, 1)]:
        out = subprocess.run([sys.executable, __file__, model, str(bench), str(trim)], capture_output=True, text=True)
        for line in out.stdout.splitlines():
            if line.startswith("ROW "): print(line)
            if line.startswith("ROWS "):
                d = json.loads(line[5:]); print(d["model"], "bench", d["bench"], "lazy", d["lazy"])
                for r in d["rows"]: print("   ", r)
        if out.returncode: print(out.stderr[-3000:])
