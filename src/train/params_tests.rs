//! Tests of `params.rs`: buckets, the CPU and device averaging paths, ZeRO's device paths.

use super::*;
use crate::train::reducer::Reducer;
use candle_core::Device;

fn var(n: usize, dtype: DType) -> Var {
    Var::zeros(n, dtype, &Device::Cpu).unwrap()
}

#[test]
fn buckets_follow_name_order_cap_and_dtype() {
    let named = vec![
        ("c".to_string(), var(10, DType::F32)),
        ("a".to_string(), var(10, DType::F32)),
        ("b".to_string(), var(10, DType::F32)),
        ("d".to_string(), var(100, DType::F32)),
        ("e".to_string(), var(4, DType::F64)),
    ];
    let p = ParamSet::new(named, 80).unwrap();
    assert_eq!(p.names, vec!["a", "b", "c", "d", "e"]);
    let b: Vec<_> = p.buckets.iter().map(|b| b.members.clone()).collect();
    // a+b = 80 bytes fit; c starts a new bucket; d is over the cap alone; e has another dtype.
    assert_eq!(b, vec![0..2, 2..3, 3..4, 4..5]);
}

#[test]
fn cpu_buckets_average_in_place_and_survive_their_own_output() {
    use crate::collective::ThreadGroup;
    let group = ThreadGroup::new(2, std::time::Duration::from_secs(20)).unwrap();
    let handles: Vec<_> = group
        .into_iter()
        .map(|c| {
            std::thread::spawn(move || {
                let r = c.rank() as f32;
                let vars: Vec<Var> = (0..3).map(|_| var(5, DType::F32)).collect();
                let named = vars
                    .iter()
                    .enumerate()
                    .map(|(i, v)| (format!("p{i}"), v.clone()))
                    .collect();
                // Buckets of 2 parameters and 1: both flat tensors are exercised.
                let set = ParamSet::new(named, 40).unwrap();
                let mut grads = GradStore::default();
                for (i, v) in vars.iter().enumerate() {
                    // `p2` has a gradient on rank 1 only.
                    if i < 2 || r == 1.0 {
                        let g = Tensor::full(r + i as f32, 5, &Device::Cpu).unwrap();
                        grads.insert(v.as_tensor(), g);
                    }
                }
                Reducer::new(set.buckets().len(), true)
                    .average_gradients(&set, &c, &mut grads)
                    .unwrap();
                let got = |g: &GradStore, i: usize| {
                    g.get(vars[i].as_tensor())
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                };
                let first: Vec<Vec<f32>> = (0..3).map(|i| got(&grads, i)).collect();
                // Feed the averaged gradients (views into the flat tensors) back in.
                Reducer::new(set.buckets().len(), true)
                    .average_gradients(&set, &c, &mut grads)
                    .unwrap();
                let second: Vec<Vec<f32>> = (0..3).map(|i| got(&grads, i)).collect();
                (first, second)
            })
        })
        .collect();
    for h in handles {
        let (first, second) = h.join().unwrap();
        // Means of (0, 1), (1, 2) and (absent = 0, 3).
        assert_eq!(first, vec![vec![0.5; 5], vec![1.5; 5], vec![1.5; 5]]);
        assert_eq!(second, first);
    }
}

/// The device path of the averaging (every bucket reduced in one batch, the presence flags
/// read back together) runs on CPU tensors too and gives what the CPU path gives.
#[test]
fn the_batched_device_average_equals_the_cpu_path() {
    use crate::collective::ThreadGroup;
    for world in 1..=3 {
        let group = ThreadGroup::new(world, std::time::Duration::from_secs(20)).unwrap();
        let handles: Vec<_> = group
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let r = c.rank();
                    let sizes = [7usize, 3, 11, 1];
                    let vars: Vec<Var> = sizes.iter().map(|&n| var(n, DType::F32)).collect();
                    let named: Vec<(String, Var)> = vars
                        .iter()
                        .enumerate()
                        .map(|(i, v)| (format!("p{i}"), v.clone()))
                        .collect();
                    // A cap of 48 bytes: several buckets.
                    let set = ParamSet::new(named, 48).unwrap();
                    assert!(set.num_buckets() > 1);
                    let grads = || {
                        let mut g = GradStore::default();
                        for (i, v) in vars.iter().enumerate() {
                            // `p1` has a gradient on rank 0 only, `p3` on none.
                            if i == 3 || (i == 1 && r != 0) {
                                continue;
                            }
                            let x: Vec<f32> = (0..v.elem_count())
                                .map(|k| (r * 7 + i * 3 + k) as f32 * 0.25)
                                .collect();
                            let t = Tensor::from_vec(x, v.elem_count(), &Device::Cpu);
                            g.insert(v.as_tensor(), t.unwrap());
                        }
                        g
                    };
                    let read = |g: &GradStore| {
                        vars.iter()
                            .map(|v| g.get(v.as_tensor()).map(|t| t.to_vec1::<f32>().unwrap()))
                            .collect::<Vec<_>>()
                    };
                    let mut a = grads();
                    Reducer::new(set.buckets().len(), false)
                        .average_gradients(&set, &c, &mut a)
                        .unwrap();
                    let mut b = grads();
                    Reducer::new(set.buckets().len(), false)
                        .average_device(&set, &c, &mut b)
                        .unwrap();
                    (read(&a), read(&b))
                })
            })
            .collect();
        for h in handles {
            let (cpu, device) = h.join().unwrap();
            assert_eq!(cpu, device, "world {world}");
            assert!(cpu[1].is_some() && cpu[3].is_none());
        }
    }
}

/// The GPU paths of ZeRO (plain tensor ops plus the tensor collectives) run on CPU tensors
/// too: for 1 to 4 ranks, odd sizes and buckets of several parameters, they must give what
/// the CPU in-place paths give, bit for bit.
#[test]
fn zero_device_paths_equal_the_cpu_paths() {
    use crate::collective::ThreadGroup;
    for world in 1..=4 {
        let group = ThreadGroup::new(world, std::time::Duration::from_secs(20)).unwrap();
        let handles: Vec<_> = group
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let r = c.rank();
                    let sizes = [7usize, 3, 11, 1];
                    let make = || -> (ParamSet, Vec<Var>) {
                        let vars: Vec<Var> = sizes
                            .iter()
                            .enumerate()
                            .map(|(i, &n)| {
                                let v: Vec<f32> = (0..n).map(|k| (i * 100 + k) as f32).collect();
                                Var::from_vec(v, n, &Device::Cpu).unwrap()
                            })
                            .collect();
                        let named = vars
                            .iter()
                            .enumerate()
                            .map(|(i, v)| (format!("p{i}"), v.clone()))
                            .collect();
                        // A cap of 48 bytes: buckets of several parameters and of one.
                        (ParamSet::new(named, 48).unwrap(), vars)
                    };
                    let grads_for = |vars: &[Var]| {
                        let mut g = GradStore::default();
                        for (i, v) in vars.iter().enumerate() {
                            // `p3` has a gradient on the last rank only.
                            if i != 3 || r + 1 == world {
                                let x: Vec<f32> = (0..v.elem_count())
                                    .map(|k| (r * 7 + i * 3 + k) as f32 * 0.25)
                                    .collect();
                                let t = Tensor::from_vec(x, v.elem_count(), &Device::Cpu);
                                g.insert(v.as_tensor(), t.unwrap());
                            }
                        }
                        g
                    };
                    let slices = |set: &ParamSet, vars: &[Var], g: &GradStore| {
                        vars.iter()
                            .map(|v| g.get(v.as_tensor()).map(|t| t.to_vec1::<f32>().unwrap()))
                            .collect::<Vec<_>>()
                            .into_iter()
                            .zip(set.names.iter().cloned())
                            .collect::<Vec<_>>()
                    };
                    let (cpu_set, cpu_vars) = make();
                    let mut g = grads_for(&cpu_vars);
                    let cpu_reducer = Reducer::new(cpu_set.buckets().len(), true);
                    let cpu_present = cpu_reducer
                        .reduce_scatter_gradients(&cpu_set, &c, &mut g)
                        .unwrap();
                    let cpu_grads = slices(&cpu_set, &cpu_vars, &g);
                    let (dev_set, dev_vars) = make();
                    let mut g = grads_for(&dev_vars);
                    let dev_reducer = Reducer::new(dev_set.buckets().len(), true);
                    let dev_present = dev_reducer
                        .reduce_scatter_gradients_device(&dev_set, &c, &mut g)
                        .unwrap();
                    let dev_grads = slices(&dev_set, &dev_vars, &g);
                    // Each rank changes only the parameters' elements it owns, then both
                    // gathers must give every rank every owner's values.
                    for set in [&cpu_set, &dev_set] {
                        for s in set.shards(world, r) {
                            let p = s.var.as_tensor().flatten_all().unwrap();
                            let new = Tensor::full(-(r as f32) - 1.0, s.range.len(), &Device::Cpu)
                                .unwrap();
                            p.slice_set(&new, 0, s.range.start).unwrap();
                        }
                    }
                    cpu_reducer.gather_params(&cpu_set, &c).unwrap();
                    dev_reducer.gather_params_device(&dev_set, &c).unwrap();
                    let values = |vars: &[Var]| {
                        vars.iter()
                            .map(|v| v.as_tensor().to_vec1::<f32>().unwrap())
                            .collect::<Vec<_>>()
                    };
                    (
                        (cpu_present, cpu_grads, values(&cpu_vars)),
                        (dev_present, dev_grads, values(&dev_vars)),
                    )
                })
            })
            .collect();
        for h in handles {
            let (cpu, dev) = h.join().unwrap();
            assert_eq!(cpu.0, vec![true; 4], "world {world}");
            assert_eq!(dev, cpu, "world {world}");
            // Every element was overwritten by its owner.
            assert!(
                cpu.2.iter().flatten().all(|&x| x < 0.0),
                "world {world}: {:?}",
                cpu.2
            );
        }
    }
}

#[test]
fn duplicate_names_are_rejected() {
    let named = vec![
        ("w".to_string(), var(1, DType::F32)),
        ("w".to_string(), var(1, DType::F32)),
    ];
    let err = ParamSet::new(named, 10).unwrap_err().to_string();
    assert!(err.contains("`w`"), "{err}");
}
