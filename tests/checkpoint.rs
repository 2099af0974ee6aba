//! Checkpoints: a training run stopped at step k, saved as one
//! `Checkpoint` (model, optimizer, scheduler, RNG) and resumed into fresh
//! objects on a fresh device continues with the uninterrupted run's
//! losses bit for bit, on the CPU backend and on wgpu; loading converts
//! f16/bf16, reports missing and unexpected keys when non-strict, renames
//! keys, reads sharded `*.safetensors.index.json` checkpoints; BatchNorm's
//! `num_batches_tracked` is counted, saved and loaded.

mod common;

use lazuli::checkpoint::Checkpoint;
use lazuli::nn::{self, Module, ModuleExt};
use lazuli::optim::{Adam, LrScheduler, Optimizer, SequentialLR};
use lazuli::serialize::{LoadOptions, LoadReport};
use lazuli::{DType, Device, DeviceExt, Tensor};
use std::collections::HashMap;
use std::path::PathBuf;

/// A fresh temporary folder for one test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lazuli-ckpt-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Linear, BatchNorm1d, ReLU, Dropout, Linear: parameters, buffers
/// (running statistics, `num_batches_tracked`) and random draws every step.
fn model(dev: &Device, seed: u64) -> nn::Sequential {
    dev.manual_seed(seed);
    nn::Sequential::new()
        .add(nn::Linear::new(6, 12, dev).unwrap())
        .add(nn::BatchNorm1d::new(12, dev).unwrap())
        .add(nn::Activation::Relu)
        .add(nn::Dropout::new(0.25))
        .add(nn::Linear::new(12, 4, dev).unwrap())
}

fn optimizer(m: &nn::Sequential) -> Adam {
    Adam::adamw_groups(lazuli::optim::decay_groups(m, 0.01), 1e-2)
}

fn scheduler(opt: &mut Adam) -> LrScheduler {
    LrScheduler::new(opt, SequentialLR::warmup_cosine(2, 8, 0.1, 1e-4)).unwrap()
}

/// `steps` training steps; each loss's bits.
fn run(dev: &Device, m: &nn::Sequential, opt: &mut Adam, sched: &mut LrScheduler, steps: usize) -> Vec<u32> {
    let x = Tensor::from_slice(&common::rand_vec(8 * 6, 31, -1.0, 1.0), [8, 6], dev).unwrap();
    let y = Tensor::from_slice(&[0i32, 1, 2, 3, 3, 2, 1, 0], [8], dev).unwrap();
    (0..steps)
        .map(|_| {
            opt.zero_grad();
            let loss = nn::cross_entropy(&m.forward(&x).unwrap(), &y).unwrap();
            loss.backward().unwrap();
            opt.step().unwrap();
            sched.step(opt).unwrap();
            dev.mark_step().unwrap();
            loss.item::<f32>().unwrap().to_bits()
        })
        .collect()
}

/// The resume check on devices made by `make` (a fresh one per run).
fn resume_is_bit_identical(make: &dyn Fn() -> Device, what: &str) {
    let dir = temp_dir(what);
    let path = dir.join("run.safetensors");
    // The uninterrupted run.
    let dev = make();
    let a = model(&dev, 5);
    let mut opt = optimizer(&a);
    let mut sched = scheduler(&mut opt);
    let want = run(&dev, &a, &mut opt, &mut sched, 6);
    // Stopped after 3 steps and saved.
    let dev = make();
    let b = model(&dev, 5);
    let mut opt = optimizer(&b);
    let mut sched = scheduler(&mut opt);
    assert_eq!(run(&dev, &b, &mut opt, &mut sched, 3), want[..3], "{what}: the first steps");
    Checkpoint::training(&b, &opt, Some(&sched), &dev).unwrap().save(&path).unwrap();
    // Resumed into fresh objects on a fresh device.
    let fresh = |restore_rng: bool| {
        let dev = make();
        let c = model(&dev, 77);
        let mut opt = optimizer(&c);
        let mut sched = scheduler(&mut opt);
        let ckpt = Checkpoint::load(&path).unwrap();
        if restore_rng {
            ckpt.restore(&c, &mut opt, Some(&mut sched), &dev).unwrap();
        } else {
            ckpt.restore_optimizer(&mut opt).unwrap();
            ckpt.restore_scheduler(&mut sched, &mut opt).unwrap();
            ckpt.restore_model(&c).unwrap();
        }
        assert_eq!(opt.steps(), 3);
        assert_eq!(sched.last_epoch(), 3);
        let bn = c.state_dict().into_iter().find(|(n, _)| n == "1.num_batches_tracked").unwrap().1;
        assert_eq!(bn.item::<i64>().unwrap(), 3, "{what}: num_batches_tracked restored");
        run(&dev, &c, &mut opt, &mut sched, 3)
    };
    assert_eq!(fresh(true), want[3..], "{what}: resumed run");
    // The test can tell: without the RNG state, dropout draws other masks.
    assert_ne!(fresh(false), want[3..], "{what}: resumed without the RNG state");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn resumed_run_is_bit_identical_on_cpu() {
    resume_is_bit_identical(&Device::cpu, "cpu");
}

#[test]
fn resumed_run_is_bit_identical_on_wgpu() {
    if common::wgpu().is_none() {
        return;
    }
    let _lock = common::metrics_lock();
    lazuli::metrics::reset();
    resume_is_bit_identical(&|| Device::wgpu().unwrap(), "wgpu");
    // The f32 run needs no fallback: num_batches_tracked counts on the host.
    assert_eq!(lazuli::metrics::counter("FallbackOps"), 0, "{}", lazuli::metrics::report());
}

#[test]
fn checkpoint_parts_are_checked() {
    let dir = temp_dir("parts");
    let dev = Device::cpu();
    let m = model(&dev, 1);
    let mut opt = optimizer(&m);
    // A checkpoint of the model alone restores the model but not the rest.
    let path = dir.join("model.safetensors");
    Checkpoint::new().model(&m).extra("epoch", &Tensor::from_slice(&[7i64], [], &dev).unwrap()).save(&path).unwrap();
    let c = Checkpoint::load(&path).unwrap();
    assert!(c.has("model") && c.has("extra") && !c.has("optimizer") && !c.has("rng"));
    assert_eq!(c.extra("epoch", &dev).unwrap().item::<i64>().unwrap(), 7);
    c.restore_model(&model(&dev, 2)).unwrap();
    let e = c.restore_optimizer(&mut opt).unwrap_err().to_string();
    assert!(e.contains("no optimizer part"), "{e}");
    let e = c.restore_rng(&dev).unwrap_err().to_string();
    assert!(e.contains("rng.seed") && e.contains("not in the checkpoint"), "{e}");
    assert!(c.extra("step", &dev).unwrap_err().to_string().contains("extra.step"));
    // Another model is refused strictly, and changes nothing.
    let other = nn::Sequential::new().add(nn::Linear::new(6, 12, &dev).unwrap());
    let before = other.parameters()[0].to_vec::<f32>().unwrap();
    let e = c.restore_model(&other).unwrap_err().to_string();
    assert!(e.contains("not in the model"), "{e}");
    assert_eq!(other.parameters()[0].to_vec::<f32>().unwrap(), before);
    // ... and loads non-strictly, reporting what it skipped.
    let report = c.restore_model_with(&other, &LoadOptions::non_strict()).unwrap();
    assert!(report.missing_keys.is_empty());
    assert_eq!(report.unexpected_keys.len(), 7, "{report:?}");
    assert_eq!(other.parameters()[0].to_vec::<f32>().unwrap(), m.parameters()[0].to_vec::<f32>().unwrap());
    // The RNG state round-trips.
    dev.manual_seed(1234);
    let _ = Tensor::rand([3], DType::F32, &dev).unwrap();
    Checkpoint::new().rng(&dev).unwrap().save(&path).unwrap();
    let state = dev.rng_state();
    assert_eq!((state.seed, state.offset), (1234, 1));
    let other_dev = Device::cpu();
    Checkpoint::load(&path).unwrap().restore_rng(&other_dev).unwrap();
    assert_eq!(other_dev.rng_state(), state);
    assert_eq!(
        Tensor::rand([5], DType::F32, &dev).unwrap().to_vec::<f32>().unwrap(),
        Tensor::rand([5], DType::F32, &other_dev).unwrap().to_vec::<f32>().unwrap()
    );
    // A missing file is an error.
    assert!(Checkpoint::load(dir.join("none.safetensors")).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Writes raw safetensors entries (name, dtype, dims, bytes) to `path`.
fn write_raw(path: &std::path::Path, entries: &[(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = entries
        .iter()
        .map(|(n, d, s, b)| (n.to_string(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

fn f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect()
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn loading_converts_half_precision_and_renames_keys() {
    let dir = temp_dir("convert");
    let dev = Device::cpu();
    let lin = nn::Linear::new(3, 2, &dev).unwrap();
    let w = [0.1f32, -0.2, 0.3, 1.0e-3, 65504.0, -7.25];
    let b = [0.5f32, -1.0 / 3.0];
    let path = dir.join("half.safetensors");
    write_raw(
        &path,
        &[
            ("weight", safetensors::Dtype::F16, vec![2, 3], f16_bytes(&w)),
            ("bias", safetensors::Dtype::BF16, vec![2], bf16_bytes(&b)),
        ],
    );
    lin.load_state_dict(&path).unwrap();
    let want_w: Vec<f32> = w.iter().map(|x| half::f16::from_f32(*x).to_f32()).collect();
    let want_b: Vec<f32> = b.iter().map(|x| half::bf16::from_f32(*x).to_f32()).collect();
    assert_eq!(lin.weight.to_vec::<f32>().unwrap(), want_w);
    assert_eq!(lin.bias.as_ref().unwrap().to_vec::<f32>().unwrap(), want_b);
    assert_eq!(lin.weight.dtype(), DType::F32);
    assert!(lin.weight.requires_grad());
    // `load` keeps file dtypes, f16 and bf16 bit for bit.
    let kept = lazuli::serialize::load(&path, &dev).unwrap();
    assert_eq!(kept["weight"].dtype(), DType::F16);
    assert_eq!(kept["bias"].dtype(), DType::BF16);
    assert_eq!(kept["weight"].to_bytes().unwrap(), f16_bytes(&w));
    assert_eq!(kept["bias"].to_bytes().unwrap(), bf16_bytes(&b));
    // Saving them writes the same dtypes and bytes back.
    let again = dir.join("again.safetensors");
    let pairs: Vec<(String, Tensor)> = ["weight", "bias"].iter().map(|k| (k.to_string(), kept[*k].clone())).collect();
    lazuli::serialize::save(&again, &pairs).unwrap();
    let reread = lazuli::serialize::load(&again, &dev).unwrap();
    assert_eq!(reread["bias"].dtype(), DType::BF16);
    assert_eq!(reread["bias"].to_vec::<half::bf16>().unwrap(), b.map(half::bf16::from_f32));
    // A bf16 target keeps a bf16 tensor's bits, and rounds an f32 one to
    // nearest even.
    let bias16 = Tensor::zeros([2], DType::BF16, &dev).unwrap();
    lazuli::serialize::load_into(&path, &[("bias".to_string(), bias16.clone())]).unwrap();
    assert_eq!(bias16.to_bytes().unwrap(), bf16_bytes(&b));
    let tie = [f32::from_bits(0x3F80_8000), f32::from_bits(0x3F80_8001)];
    write_raw(&again, &[("bias", safetensors::Dtype::F32, vec![2], f32_bytes(&tie))]);
    lazuli::serialize::load_into(&again, &[("bias".to_string(), bias16.clone())]).unwrap();
    let bits: Vec<u16> = bias16.to_vec::<half::bf16>().unwrap().iter().map(|x| x.to_bits()).collect();
    assert_eq!(bits, [0x3F80, 0x3F81]);
    // A dtype Lazuli lacks is still refused by name.
    write_raw(&again, &[("bias", safetensors::Dtype::F8_E4M3, vec![2], vec![0; 2])]);
    let e = lazuli::serialize::load(&again, &dev).unwrap_err().to_string();
    assert!(e.contains("bias") && e.contains("F8_E4M3"), "{e}");
    // A shape mismatch, or an int tensor into a float one, is refused by name.
    write_raw(
        &path,
        &[
            ("weight", safetensors::Dtype::F32, vec![3, 2], f32_bytes(&w)),
            ("bias", safetensors::Dtype::I32, vec![2], vec![0; 8]),
        ],
    );
    let e = lin.load_state_dict(&path).unwrap_err().to_string();
    assert!(e.contains("weight") && e.contains("[3, 2]"), "{e}");
    // Renaming: the file's `head.*` are this module's tensors; others are dropped.
    write_raw(
        &path,
        &[
            ("head.weight", safetensors::Dtype::F32, vec![2, 3], f32_bytes(&w)),
            ("head.bias", safetensors::Dtype::F32, vec![2], f32_bytes(&b)),
            ("body.weight", safetensors::Dtype::F32, vec![1], f32_bytes(&[1.0])),
        ],
    );
    let opts = LoadOptions::strict().rename(|k| k.strip_prefix("head.").map(str::to_string));
    assert_eq!(lin.load_state_dict_with(&path, &opts).unwrap(), LoadReport::default());
    assert_eq!(lin.weight.to_vec::<f32>().unwrap(), w);
    // A map renames some keys and keeps the others.
    let map = HashMap::from([("head.weight".to_string(), "weight".to_string())]);
    let report = lin.load_state_dict_with(&path, &LoadOptions::non_strict().rename_map(map)).unwrap();
    assert_eq!(report.missing_keys, ["bias"]);
    assert_eq!(report.unexpected_keys, ["body.weight", "head.bias"]);
    // Strict without renaming names the first missing tensor; nothing changes.
    lin.weight.assign(&Tensor::zeros([2, 3], DType::F32, &dev).unwrap()).unwrap();
    let e = lin.load_state_dict(&path).unwrap_err().to_string();
    assert!(e.contains("\"weight\"") && e.contains("not in the file"), "{e}");
    assert_eq!(lin.weight.to_vec::<f32>().unwrap(), [0.0; 6]);
    // One tensor listed under one name twice (tied weights) loads into both.
    let (a, b) = (Tensor::zeros([2, 3], DType::F32, &dev).unwrap(), Tensor::zeros([2, 3], DType::F32, &dev).unwrap());
    let targets = [("weight".to_string(), a.clone()), ("weight".to_string(), b.clone())];
    let opts = LoadOptions::non_strict().rename(|k| k.strip_prefix("head.").map(str::to_string));
    let report = lazuli::serialize::load_into_with(&path, &targets, &opts).unwrap();
    assert_eq!(report.unexpected_keys, ["bias"]);
    assert_eq!(a.to_vec::<f32>().unwrap(), w);
    assert_eq!(b.to_vec::<f32>().unwrap(), w);
    // Two keys renamed onto one name are refused.
    let e = lin.load_state_dict_with(&path, &LoadOptions::non_strict().rename(|_| Some("weight".into())));
    assert!(e.unwrap_err().to_string().contains("both renamed"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sharded_checkpoints_load_through_their_index() {
    let dir = temp_dir("sharded");
    let dev = Device::cpu();
    let src = nn::Sequential::new().add(nn::Linear::new(4, 3, &dev).unwrap()).add(nn::Linear::new(3, 2, &dev).unwrap());
    let state = src.state_dict();
    // Two shards and the Hugging Face index.
    lazuli::serialize::save(dir.join("model-00001-of-00002.safetensors"), &state[..2]).unwrap();
    lazuli::serialize::save(dir.join("model-00002-of-00002.safetensors"), &state[2..]).unwrap();
    let mut map = serde_json::Map::new();
    for (i, (name, _)) in state.iter().enumerate() {
        let shard = if i < 2 { "model-00001-of-00002.safetensors" } else { "model-00002-of-00002.safetensors" };
        map.insert(name.clone(), serde_json::Value::String(shard.into()));
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    let index_path = dir.join("model.safetensors.index.json");
    std::fs::write(&index_path, index.to_string()).unwrap();
    let dst = nn::Sequential::new().add(nn::Linear::new(4, 3, &dev).unwrap()).add(nn::Linear::new(3, 2, &dev).unwrap());
    dst.load_state_dict(&index_path).unwrap();
    for ((n, a), (_, b)) in src.state_dict().iter().zip(dst.state_dict()) {
        assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap(), "{n}");
    }
    assert_eq!(lazuli::serialize::load(&index_path, &dev).unwrap().len(), 4);
    // A bad index: not JSON, no weight_map, a shard outside the folder, a
    // tensor its shard lacks.
    let bad = |text: &str| {
        std::fs::write(&index_path, text).unwrap();
        dst.load_state_dict(&index_path).unwrap_err().to_string()
    };
    assert!(bad("{").contains("not a safetensors shard index"));
    assert!(bad("{\"metadata\": {}}").contains("weight_map"));
    assert!(bad("{\"weight_map\": {\"0.weight\": \"../x.safetensors\"}}").contains("plain file name"));
    let e = bad("{\"weight_map\": {\"0.nope\": \"model-00001-of-00002.safetensors\"}}");
    assert!(e.contains("0.nope"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn batch_norm_counts_batches_in_training_only() {
    let dev = Device::cpu();
    let bn = nn::BatchNorm2d::new(2, &dev).unwrap();
    let names: Vec<String> = bn.state_dict().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]);
    assert_eq!(bn.num_batches_tracked.dtype(), DType::I64);
    assert_eq!(bn.num_batches_tracked.rank(), 0);
    let x = Tensor::from_slice(&common::rand_vec(2 * 2 * 3 * 3, 4, -1.0, 1.0), [2, 2, 3, 3], &dev).unwrap();
    for _ in 0..3 {
        bn.forward(&x).unwrap();
    }
    assert_eq!(bn.num_batches_tracked.item::<i64>().unwrap(), 3);
    bn.eval();
    bn.forward(&x).unwrap();
    assert_eq!(bn.num_batches_tracked.item::<i64>().unwrap(), 3);
    // It stays on the host: counting never waits on the device.
    assert_eq!(bn.num_batches_tracked.state(), lazuli::TensorState::HostData);
}

/// The `examples/gpt_text.rs` loop on the bench's tiny GPT: a shuffled
/// `DataLoader` over token windows, AdamW, warmup + cosine; resuming from
/// `resume` (skipping the batches of the epoch already used) and stopping
/// after `stop` steps, saving a checkpoint there. Each loss's bits.
fn gpt_run(path: &std::path::Path, resume: bool, stop: u64) -> Vec<u32> {
    use lazuli::data::{DataLoader, HostArray, TensorDataset};
    use lazuli_models::gpt::{GptModel, GptSizes};
    let sizes = GptSizes::TINY;
    let dev = Device::cpu();
    let t = sizes.context;
    let text: Vec<i32> = (0..40).map(|i| ((i * 7 + i / 3) % sizes.vocab) as i32).collect();
    let windows = text.len() - t;
    let tokens: Vec<i32> = (0..windows).flat_map(|i| text[i..i + t + 1].to_vec()).collect();
    let data = TensorDataset::new(vec![HostArray::from_slice(&tokens, &[windows, t + 1]).unwrap()]).unwrap();
    let loader = DataLoader::new(data, sizes.batch, &dev).unwrap().shuffle(9).drop_last(true);
    dev.manual_seed(if resume { 1 } else { 0 });
    let model = GptModel::new(sizes, &dev).unwrap();
    let mut opt = Adam::adamw_groups(lazuli::optim::decay_groups(&model, 0.1), 3e-3);
    let mut sched = LrScheduler::new(&mut opt, SequentialLR::warmup_cosine(2, 12, 0.1, 3e-4)).unwrap();
    let mut step = 0u64;
    if resume {
        let ckpt = Checkpoint::load(path).unwrap();
        ckpt.restore(&model, &mut opt, Some(&mut sched), &dev).unwrap();
        step = ckpt.extra("step", &dev).unwrap().item::<i64>().unwrap() as u64;
    }
    let per_epoch = loader.len() as u64;
    let mut losses = Vec::new();
    while step < stop {
        let (epoch, skip) = (step / per_epoch, (step % per_epoch) as usize);
        for batch in loader.epoch(epoch).unwrap().skip(skip) {
            if step == stop {
                break;
            }
            let w = &batch.unwrap()[0];
            let ids = w.narrow(1, 0, t).unwrap().reshape([-1]).unwrap();
            let targets = w.narrow(1, 1, t).unwrap().reshape([-1]).unwrap();
            opt.zero_grad();
            let loss = nn::cross_entropy(&model.forward(&ids).unwrap(), &targets).unwrap();
            loss.backward().unwrap();
            opt.step().unwrap();
            sched.step(&mut opt).unwrap();
            dev.mark_step().unwrap();
            step += 1;
            losses.push(loss.item::<f32>().unwrap().to_bits());
        }
    }
    let step_t = Tensor::from_slice(&[step as i64], [], &dev).unwrap();
    Checkpoint::training(&model, &opt, Some(&sched), &dev).unwrap().extra("step", &step_t).save(path).unwrap();
    losses
}

#[test]
fn the_gpt_example_loop_resumes_bit_for_bit_across_an_epoch_boundary() {
    let dir = temp_dir("gpt");
    let path = dir.join("gpt.safetensors");
    // 32 windows in batches of 3: 10 steps an epoch; stop mid-epoch at 7,
    // resume into the next epoch.
    let want = gpt_run(&path, false, 14);
    assert_eq!(gpt_run(&path, false, 7), want[..7]);
    assert_eq!(gpt_run(&path, true, 14), want[7..]);
    std::fs::remove_dir_all(&dir).unwrap();
}
