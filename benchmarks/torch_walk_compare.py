"""Compare the ONNX exports of the imported runs with PyTorch's logits (benchmarks/torch_walk_train.py)
on the same uint8 test images, and time the RepBN export folded against unfolded in ONNX Runtime
(2 threads). DIR holds what torch_walk_train wrote and the exports DIR/onnx/<run>/model.onnx of the
imported runs ln, ln_tanh, ln_eps5, ln_eps12, repbn, repbn_tanh (docs/pretrained.md, "Measured with
trained weights", gives their flags), plus ln/folded.onnx and repbn/folded.onnx (--fold):

    python -m benchmarks.torch_walk_compare --dir=DIR
"""
import argparse, time, numpy as np, onnxruntime as ort
ap = argparse.ArgumentParser(); ap.add_argument('--dir', required=True)
D = ap.parse_args().dir; x = np.load(f'{D}/test_u8.npy'); y = np.load(f'{D}/test_y.npy')
def sm(z): e = np.exp(z - z.max(1, keepdims=True)); return e / e.sum(1, keepdims=True)
def sess(p):
    o = ort.SessionOptions(); o.intra_op_num_threads = 2; o.inter_op_num_threads = 1
    return ort.InferenceSession(p, o, providers=['CPUExecutionProvider'])
S = {}
for tor, names in [('ln', ['ln/model', 'ln/folded', 'ln_tanh/model', 'ln_eps5/model', 'ln_eps12/model']),
                   ('repbn', ['repbn/model', 'repbn/folded', 'repbn_tanh/model'])]:
    t = np.load(f'{D}/{tor}_logits.npy'); pt = sm(t.astype(np.float64))
    print(f'{tor}: torch top-1 {(t.argmax(1) == y).mean():.4f}, |logit| max {np.abs(t).max():.2f}, std {t.std():.2f}')
    for n in names:
        s = S[n] = sess(f'{D}/onnx/{n}.onnx')
        p, l = s.run(['probabilities', 'logits'], {'image': x})
        print(f'  {n:18s} top-1 {(l.argmax(1) == y).mean():.4f}  argmax = torch on {(l.argmax(1) == t.argmax(1)).sum()}/{len(y)}'
              f'  max|dlogit| {np.abs(l - t).max():.2e} (median per image {np.median(np.abs(l - t).max(1)):.1e})  max|dprob| {np.abs(p - pt).max():.2e}')
R, K = 15, 50
print(f'latency, ONNX Runtime 2 threads, ms per call ({R} rounds x {K} calls, order alternating; median, p25-p75; ratio: median of per-round folded/unfolded):')
for b in (1, 32):
    xb = x[:b]; ts = {n: [] for n in ('repbn/model', 'repbn/folded')}
    for n in ts: [S[n].run(['logits'], {'image': xb}) for _ in range(10)]
    for r in range(R):
        for n in (list(ts) if r % 2 == 0 else list(ts)[::-1]):
            t0 = time.perf_counter()
            for _ in range(K): S[n].run(['logits'], {'image': xb})
            ts[n].append((time.perf_counter() - t0) / K * 1e3)
    u, f = np.array(ts['repbn/model']), np.array(ts['repbn/folded']); q = lambda v: f'{np.median(v):.3f} ({np.percentile(v,25):.3f}-{np.percentile(v,75):.3f})'
    print(f'  batch {b}: unfolded {q(u)}, folded {q(f)}, folded/unfolded {np.median(f/u):.3f} ({np.percentile(f/u,25):.3f}-{np.percentile(f/u,75):.3f})')
