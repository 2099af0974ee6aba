// Hand-written baseline for workload W1: y = tanh(relu(x * a + b) - c) * d,
// one pass, one vec4 per invocation. Used by `lazuli bench` to judge the
// generated elementwise kernel on the same adapter.

struct Params {
    n4: u32,
    a: f32,
    b: f32,
    c: f32,
    d: f32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> y: array<vec4<f32>>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= P.n4) {
        return;
    }
    let v = x[i];
    y[i] = tanh(max(v * P.a + P.b, vec4<f32>(0.0)) - P.c) * P.d;
}
