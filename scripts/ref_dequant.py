#!/usr/bin/env python3
"""Writes tests/golden/dequant_<TYPE>.bin: raw weight blocks with their dequantized values, as
computed by an independent implementation (the gguf package's numpy dequantizer), for
tests/test_weights.cpp to compare kvq's dequantize_row_ref against.

Each file is a sequence of records (little-endian):
  b"KVQD", u32 ggml type id, u32 n_elements, u32 n_bytes, n_bytes raw bytes, n_elements float32.
Records: random blocks for every type (scale fields set to chosen fp16 values: ordinary, tiny,
subnormal, zero, negative, large; MXFP4's E8M0 scale byte to the subnormal, smallest, ordinary and
largest exponents), plus, when the model files are given, the first blocks of a
few rows of a real tensor of each type each file contains.

usage: ref_dequant.py OUT_DIR [MODEL.gguf ...]     (pip install gguf numpy)
"""
import struct
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T, GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

# byte offsets of the fp16 scale fields inside each block
F16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
              T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.Q2_K: [80, 82], T.Q3_K: [108],
              T.IQ4_NL: [0], T.IQ4_XS: [0]}
SCALES = [0.0123, -0.0071, 3.0e-3, 6.1e-5, 2.0e-6, 0.0, 1.5, -250.0]  # 2e-6 is an fp16 subnormal
# byte offsets of the E8M0 scale bytes (2^(e - 127), halved with the doubled MXFP4 levels), and the
# exponents they get: 2^-128 and 2^-127 are float subnormals, 254 and 255 overflow the larger levels
E8M0_FIELDS = {T.MXFP4: [0]}
E8M0S = [0, 1, 2, 127, 128, 254, 255, 119]


def record(f, qtype, raw: np.ndarray):
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    vals = dequantize(raw, qtype).astype(np.float32).reshape(-1)
    f.write(b"KVQD" + struct.pack("<III", int(qtype), vals.size, raw.size))
    f.write(raw.tobytes())
    f.write(vals.tobytes())


def synthetic(qtype, rng):
    if qtype == T.F32:
        v = rng.standard_normal(64).astype(np.float32)
        v[:4] = [0.0, -0.0, 1e-40, 3e38]
        return v.view(np.uint8)
    if qtype == T.F16:
        v = (rng.standard_normal(64) * 4).astype(np.float16)
        v[:5] = [0.0, -0.0, 6e-8, 65504.0, -1e-5]
        return v.view(np.uint8)
    if qtype == T.BF16:
        v = (rng.standard_normal(64) * 10).astype(np.float32)
        v[:4] = [0.0, -1e-39, 1e30, -3.0]
        return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    bs, ts = GGML_QUANT_SIZES[qtype]
    nblk = len(SCALES) if bs == 32 else 4
    raw = rng.integers(0, 256, size=(nblk, ts), dtype=np.uint8)
    for i in range(nblk):
        for k, off in enumerate(F16_FIELDS.get(qtype, [])):
            s = np.float16(SCALES[(i + 3 * k) % nblk])
            raw[i, off:off + 2] = np.frombuffer(s.tobytes(), dtype=np.uint8)
        for off in E8M0_FIELDS.get(qtype, []):
            raw[i, off] = E8M0S[i % len(E8M0S)]
    return raw


def real_rows(path, want):
    r = GGUFReader(path)
    out = {}
    for t in r.tensors:
        qt = t.tensor_type
        if qt not in want or qt in out or len(t.shape) < 2:
            continue
        bs, ts = GGML_QUANT_SIZES[qt]
        data = np.asarray(t.data).view(np.uint8)
        rows = data.reshape(int(t.shape[1]), -1)
        nb = min(rows.shape[1] // ts, 4 if bs == 32 else 1)  # a few blocks per row keep files small
        pick = [0, rows.shape[0] // 2, rows.shape[0] - 1]
        out[qt] = [(t.name, rows[p, :nb * ts]) for p in pick]
    return out


def main():
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    # new types go at the end: the random stream, and so the earlier files, stay the same
    types = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K,
             T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4]
    rng = np.random.default_rng(20240611)
    real = {}
    for model in sys.argv[2:]:
        for qt, recs in real_rows(model, set(types) - {T.F32}).items():
            real.setdefault(qt, []).extend(recs)
    for qt in types:
        with open(out_dir / f"dequant_{qt.name}.bin", "wb") as f:
            record(f, qt, synthetic(qt, rng))
            for name, raw in real.get(qt, []):
                record(f, qt, raw)
        print(qt.name, (out_dir / f"dequant_{qt.name}.bin").stat().st_size, "bytes,",
              len(real.get(qt, [])), "real rows")


if __name__ == "__main__":
    main()
