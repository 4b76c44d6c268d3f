import os, subprocess, sys, tempfile, torch
sys.path.insert(0, os.getcwd())
from model_new import GemmMultiplyLeakyReLUModelNew, LeakyReLUModelNew
RUN = r"""
import sys, torch
print("start", flush=True)
sys.path.insert(0, sys.argv[1])
import kernels.functional
print("imported", flush=True)
p = torch._inductor.aoti_load_package(sys.argv[2])
print("loaded", flush=True)
x = torch.load(sys.argv[3])
y = p(x)
print("ran", y.shape, flush=True)
"""
subprocess.run(["gcc", "-shared", "-fPIC", "-o", "/tmp/segv.so", "tools/segv_backtrace.c", "-ldl"], check=True)
for device in sys.argv[1:]:
    d = tempfile.mkdtemp()
    for name, model, x in [("leaky", LeakyReLUModelNew(0.1), torch.randn(8, 64)), ("gemm", GemmMultiplyLeakyReLUModelNew(64, 32, 2.0, 0.1), torch.randn(8, 64))]:
        model, x = model.to(device), x.to(device)
        with torch.no_grad():
            pkg = torch._inductor.aoti_compile_and_package(torch.export.export(model, (x,)), package_path=f"{d}/{name}.pt2")
        torch.save(x, f"{d}/x.pt")
        r = subprocess.run([sys.executable, "-c", RUN, os.getcwd(), pkg, f"{d}/x.pt"], capture_output=True, text=True, env={**os.environ, "LD_PRELOAD": "/tmp/segv.so"})
        print(device, name, "rc", r.returncode, r.stdout, r.stderr[-3000:], flush=True)
