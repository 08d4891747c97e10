//! The `processes` setting: how many processes a program started on its own (not by a launcher)
//! runs as. With `n > 1`, [`AcceleratorBuilder::build`](crate::AcceleratorBuilder::build) starts
//! `n` copies of the program as workers and supervises them instead of training itself (the
//! self-launch, in the spirit of `torch.multiprocessing.spawn`). Builder
//! [`processes`](crate::AcceleratorBuilder::processes) > `ACCELERATE_RS_NUM_PROCESSES` > 1; no
//! config key, since the config file's `num_processes` is `accelerate-rs launch`'s (a config
//! file written for the launcher must not make a plain `./train` start several processes).

use crate::error::{Error, Result};
use crate::settings::overrides::Overrides;
use crate::settings::parse::{env_value, pick};
use crate::settings::place::launched_by;
use crate::settings::{env, limits, ConfigFile};

/// What a program started on its own should do: start `processes` workers of itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SelfLaunch {
    /// How many worker processes to start (at least 2).
    pub(crate) processes: usize,
    /// Whether the CPU was asked for (builder, `ACCELERATE_RS_USE_CPU` or `use_cpu`); `None`:
    /// nobody said, so the workers use GPUs when they have them.
    pub(crate) use_cpu: Option<bool>,
    /// The run's secret for the workers (builder > `ACCELERATE_RS_SECRET`); `None`: a random one.
    pub(crate) secret: Option<String>,
}

/// `Some` when this process must start workers of itself instead of joining a run: more than one
/// process was asked for and nothing placed this process in a run yet (no launcher variables
/// such as `RANK`, no rank, world size or collective given to the builder). A worker started by
/// the self-launch has `RANK` set, so it joins the run.
pub(crate) fn self_launch(
    o: &Overrides,
    getenv: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<SelfLaunch>> {
    let from_env = env_value::<usize>(getenv, env::NUM_PROCESSES)?;
    let n = pick(o.processes, from_env, None, 1);
    let source = if o.processes.is_some() {
        "processes".to_string()
    } else {
        env::NUM_PROCESSES.to_string()
    };
    if n == 0 || n > limits::MAX_PROCESSES {
        let reason = format!(
            "the number of processes must be from 1 to {}, got {n}",
            limits::MAX_PROCESSES
        );
        return Err(match o.processes {
            Some(_) => Error::invalid(source, reason),
            None => Error::Env {
                var: source,
                value: n.to_string(),
                reason,
            },
        });
    }
    let placed = o.rank.is_some()
        || o.world_size.is_some()
        || o.external_collective
        || o.replica_device.is_some();
    if n == 1 || placed || launched_by(getenv).is_some() {
        return Ok(None);
    }
    let replicas = pick(
        o.data_parallel,
        env_value::<usize>(getenv, env::DATA_PARALLEL)?,
        None,
        1,
    );
    if replicas > 1 {
        return Err(Error::invalid(
            source,
            format!(
                "{n} processes and {replicas} DP replicas were asked for: DP drives its replicas from one process; ask for one or the other"
            ),
        ));
    }
    let (cfg, _) = ConfigFile::load_located(o.config_file.as_deref(), getenv)?;
    let use_cpu = o.cpu.or(env_value(getenv, env::USE_CPU)?).or(cfg.use_cpu);
    let secret = pick(
        o.secret.clone(),
        env_value::<String>(getenv, env::SECRET)?,
        None,
        String::new(),
    );
    Ok(Some(SelfLaunch {
        processes: n,
        use_cpu,
        secret: (!secret.is_empty()).then_some(secret),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn decide(vars: &[(&str, &str)], o: Overrides) -> Result<Option<SelfLaunch>> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let empty = tempfile::NamedTempFile::new().unwrap();
        let o = Overrides {
            config_file: Some(empty.path().to_path_buf()),
            ..o
        };
        self_launch(&o, &|k| map.get(k).cloned())
    }

    #[test]
    fn builder_beats_the_environment_and_one_process_launches_nothing() {
        assert_eq!(decide(&[], Overrides::default()).unwrap(), None);
        let n = |r: Option<SelfLaunch>| r.map(|s| s.processes);
        assert_eq!(
            n(decide(&[(env::NUM_PROCESSES, "3")], Overrides::default()).unwrap()),
            Some(3)
        );
        let builder = Overrides {
            processes: Some(2),
            ..Overrides::default()
        };
        assert_eq!(
            n(decide(&[(env::NUM_PROCESSES, "3")], builder).unwrap()),
            Some(2)
        );
        let one = Overrides {
            processes: Some(1),
            ..Overrides::default()
        };
        assert_eq!(decide(&[(env::NUM_PROCESSES, "3")], one).unwrap(), None);
        let cpu = decide(
            &[(env::NUM_PROCESSES, "2"), (env::USE_CPU, "1")],
            Overrides::default(),
        );
        assert_eq!(cpu.unwrap().and_then(|s| s.use_cpu), Some(true));
    }

    #[test]
    fn a_worker_or_a_placed_process_does_not_launch_again() {
        let vars = [(env::NUM_PROCESSES, "2"), (env::RANK, "1")];
        assert_eq!(decide(&vars, Overrides::default()).unwrap(), None);
        let vars = [(env::NUM_PROCESSES, "2"), (env::SLURM_PROCID, "0")];
        assert_eq!(decide(&vars, Overrides::default()).unwrap(), None);
        let placed = Overrides {
            rank: Some(0),
            world_size: Some(1),
            ..Overrides::default()
        };
        assert_eq!(decide(&[(env::NUM_PROCESSES, "2")], placed).unwrap(), None);
    }

    #[test]
    fn bad_values_name_the_variable_or_the_builder_call() {
        let e = decide(&[(env::NUM_PROCESSES, "two")], Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains(env::NUM_PROCESSES) && e.contains("two"), "{e}");
        let e = decide(&[(env::NUM_PROCESSES, "0")], Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(env::NUM_PROCESSES) && e.contains("from 1"),
            "{e}"
        );
        let zero = Overrides {
            processes: Some(0),
            ..Overrides::default()
        };
        let e = decide(&[], zero).unwrap_err().to_string();
        assert!(e.contains("processes") && e.contains("got 0"), "{e}");
        let e = decide(
            &[(env::NUM_PROCESSES, "2"), (env::DATA_PARALLEL, "2")],
            Overrides::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("DP"), "{e}");
    }
}
