// Naive baseline for workload W2: one invocation per output element,
// looping over K. Used by `lazuli bench` to judge the generated matmul
// kernel on the same adapter.

struct Params {
    m: u32,
    n: u32,
    k: u32,
    pad: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;

@compute @workgroup_size(16, 16)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let col = gid.x;
    let row = gid.y;
    if (row >= P.m || col >= P.n) {
        return;
    }
    var acc = 0.0;
    for (var k = 0u; k < P.k; k = k + 1u) {
        acc = acc + a[row * P.k + k] * b[k * P.n + col];
    }
    c[row * P.n + col] = acc;
}
