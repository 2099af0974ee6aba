//! Devices as users assume: `Tensor::to_device` round trips (values,
//! pending values, gradients) between the CPU backend and the wgpu
//! adapter, a model moved in place (`ModuleExt::to_device`) or loaded
//! from another model's state in memory, and what `Device::default()`
//! chooses.

mod common;

use lazuli::nn::{self, Linear, Module, ModuleExt};
use lazuli::prelude::*;

/// The CPU device and the adapter's (when there is one), both ways.
fn pairs() -> Vec<(Device, Device)> {
    let mut v = vec![(Device::cpu(), Device::cpu())];
    if let Some(g) = common::wgpu() {
        v.push((Device::cpu(), g.clone()));
        v.push((g, Device::cpu()));
    }
    v
}

#[test]
fn to_device_round_trips() {
    for (a, b) in pairs() {
        let what = format!("{} -> {}", a.name(), b.name());
        let host = Tensor::from_slice(&[1.0f32, -2.0, 3.5, 0.25], [2, 2], &a).unwrap();
        let there = host.to_device(&b).unwrap();
        assert!(there.device().same(&b) && there.shape() == host.shape(), "{what}");
        assert_eq!(there.to_device(&a).unwrap().to_vec::<f32>().unwrap(), host.to_vec::<f32>().unwrap(), "{what}");
        // A pending value is computed first; an integer one keeps its dtype.
        let pending = host.mul_scalar(2.0).unwrap().relu().unwrap();
        assert_eq!(pending.to_device(&b).unwrap().to_vec::<f32>().unwrap(), vec![2.0, 0.0, 7.0, 0.5], "{what}");
        let ids = Tensor::from_slice(&[3i32, -1, 7], [3], &a).unwrap().add_scalar(1).unwrap();
        assert_eq!(ids.to_device(&b).unwrap().to_vec::<i32>().unwrap(), vec![4, 0, 8], "{what}");
        // The same device: the same tensor.
        assert_eq!(host.to_device(&a).unwrap().id(), host.id(), "{what}");
    }
}

#[test]
fn a_gradient_moves_back_across_devices() {
    for (a, b) in pairs() {
        let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0], [3], &a).unwrap().requires_grad_(true).unwrap();
        let y = x.to_device(&b).unwrap().mul_scalar(3.0).unwrap().sum_all().unwrap();
        y.backward().unwrap();
        let g = x.grad().expect("a gradient on the source device");
        assert!(g.device().same(&a));
        assert_eq!(g.to_vec::<f32>().unwrap(), vec![3.0; 3], "{} -> {}", a.name(), b.name());
    }
}

#[test]
fn operands_on_two_devices_say_how_to_move_one() {
    let (a, b) = (Device::cpu(), Device::cpu());
    let x = Tensor::zeros([2], DType::F32, &a).unwrap();
    let y = Tensor::zeros([2], DType::F32, &b).unwrap();
    let line = line!() + 1;
    let e = x.add(&y).unwrap_err().to_string();
    assert!(e.contains("different devices") && e.contains(".to_device(&device)"), "{e}");
    assert!(e.contains(&format!("{}:{line}", file!())), "{e}");
    assert_eq!(x.add(&y.to_device(&a).unwrap()).unwrap().to_vec::<f32>().unwrap(), vec![0.0, 0.0]);
}

#[derive(Module)]
struct Tied {
    embed: nn::Embedding,
    head: Linear,
    #[module(buffer)]
    scale: Tensor,
}

impl Tied {
    fn new(dev: &Device) -> Tied {
        let embed = nn::Embedding::new(5, 3, dev).unwrap();
        let mut head = Linear::with_init(3, 5, false, nn::Init::LecunUniform, nn::Init::LecunUniform, dev).unwrap();
        head.weight = embed.weight.clone();
        Tied { embed, head, scale: Tensor::full([1], 2.0f32, DType::F32, dev).unwrap() }
    }

    fn forward(&self, ids: &Tensor) -> lazuli::Result<Tensor> {
        self.head.forward(&self.embed.forward(ids)?.mul(&self.scale)?)
    }
}

#[test]
fn a_model_moves_in_place_and_keeps_its_ties() {
    for (a, b) in pairs() {
        a.manual_seed(5);
        let mut m = Tied::new(&a);
        let ids = Tensor::from_slice(&[0i32, 4, 2], [3], &a).unwrap();
        let before = m.forward(&ids).unwrap().to_vec::<f32>().unwrap();
        m.forward(&ids).unwrap().sum_all().unwrap().backward().unwrap();
        m.to_device(&b).unwrap();
        for (name, t) in m.state_dict() {
            assert!(t.device().same(&b), "{name} moved");
        }
        assert_eq!(m.embed.weight.id(), m.head.weight.id(), "the tie survives the move");
        assert!(m.embed.weight.requires_grad() && m.embed.weight.is_leaf(), "a parameter stays a leaf");
        assert!(!m.scale.requires_grad(), "a buffer stays a buffer");
        assert!(m.embed.weight.grad().is_some_and(|g| g.device().same(&b)), "its gradient moved with it");
        let after = m.forward(&ids.to_device(&b).unwrap()).unwrap().to_vec::<f32>().unwrap();
        common::assert_close(&after, &before, 1e-5, 1e-6, &format!("{} -> {}", a.name(), b.name()));
    }
}

/// A module that lists a tensor but gives no mutable access to it.
struct Opaque {
    w: Tensor,
}

impl Module for Opaque {
    fn forward(&self, x: &Tensor) -> lazuli::Result<Tensor> {
        x.mul(&self.w)
    }

    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("w".into(), self.w.clone())]
    }
}

#[test]
fn a_module_that_hides_its_tensors_is_not_half_moved() {
    let dev = Device::cpu();
    let mut seq = nn::Sequential::new()
        .add(Linear::new(2, 2, &dev).unwrap())
        .add(Opaque { w: Tensor::ones([2], DType::F32, &dev).unwrap() });
    let other = Device::cpu();
    let e = seq.to_device(&other).unwrap_err().to_string();
    assert!(e.contains("1.w") && e.contains("own_tensors_mut"), "{e}");
    assert!(seq.parameters().iter().all(|p| p.device().same(&dev)), "nothing moved");
}

#[test]
fn a_state_dict_loads_from_memory_across_devices() {
    for (a, b) in pairs() {
        a.manual_seed(1);
        b.manual_seed(2);
        let src = Linear::new(3, 2, &a).unwrap();
        let dst = Linear::new(3, 2, &b).unwrap();
        let id = dst.weight.id();
        dst.load_state_dict_from(&src.state_dict()).unwrap();
        assert_eq!(dst.weight.id(), id, "loaded in place");
        assert!(dst.weight.device().same(&b));
        assert_eq!(dst.weight.to_vec::<f32>().unwrap(), src.weight.to_vec::<f32>().unwrap());
        assert_eq!(
            dst.bias.as_ref().unwrap().to_vec::<f32>().unwrap(),
            src.bias.as_ref().unwrap().to_vec::<f32>().unwrap()
        );
        // A strict load of another model's state names every key that
        // does not match and the way out.
        let wider = Linear::with_init(3, 2, false, nn::Init::LecunUniform, nn::Init::LecunUniform, &a).unwrap();
        let mut state = wider.state_dict();
        state.push(("extra".into(), Tensor::zeros([1], DType::F32, &a).unwrap()));
        let e = dst.load_state_dict_from(&state).unwrap_err().to_string();
        assert!(e.contains("\"bias\"") && e.contains("\"extra\"") && e.contains("LoadOptions::non_strict()"), "{e}");
        let report = dst.load_state_dict_from_with(&state, &lazuli::serialize::LoadOptions::non_strict()).unwrap();
        assert_eq!(
            (report.missing_keys, report.unexpected_keys),
            (vec!["bias".to_string()], vec!["extra".to_string()])
        );
    }
}

#[test]
fn the_default_device_is_the_fastest_real_one() {
    let (dev, choice) = Device::default_choice().unwrap();
    let hardware =
        lazuli::adapters().iter().any(|a| ["DiscreteGpu", "IntegratedGpu", "VirtualGpu"].iter().any(|k| a.contains(k)));
    match std::env::var("LAZULI_DEVICE").ok().as_deref() {
        Some("cpu") => assert_eq!(choice.kind, lazuli::DeviceKind::Cpu),
        Some("wgpu") => assert!(choice.reason.contains("LAZULI_DEVICE=wgpu"), "{}", choice.reason),
        _ if hardware => assert_eq!(choice.kind, lazuli::DeviceKind::Wgpu, "{}", choice.reason),
        _ => {
            // Here (CI: lavapipe only, or no adapter) the CPU backend,
            // and the reason says why.
            assert_eq!(choice.kind, lazuli::DeviceKind::Cpu, "{}", choice.reason);
            assert_eq!(dev.kind(), lazuli::BackendKind::Cpu);
            assert!(choice.reason.contains("no hardware GPU adapter"), "{}", choice.reason);
        }
    }
}
