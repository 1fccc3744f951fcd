//! The family seam: a toy family defined here, in the tests crate alone, plans through
//! `tpinfer-plan` and runs on the runtime's rank group without any change to the planner, the
//! runtime or the engines.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use safetensors::tensor::{Dtype, TensorView};
use tpinfer_family::{Family, LoadContext};
use tpinfer_layers::{split_evenly, ColumnParallelLinear, RowParallelLinear};
use tpinfer_plan::{
    boxed_shards, fit_table, over_budget_message, Accelerator, DeviceProfile, Footprint, Placement, Plan, PlanError,
    RankShard, ShardedModel,
};
use tpinfer_runtime::{DeviceKind, GroupOptions, Launch, RuntimeError, Topology};
use tpinfer_tests::tensor_rel_error;
use tpinfer_weights::{SafetensorsStore, ShardLoader, WeightDecl, WeightStore};

/// `y = down(relu(up(x)))`: `up` split by output columns, `down` by input rows, one
/// all-reduce. Its directory holds `toy.json` and `model.safetensors`.
struct ToyMlp {
    name: String,
    hidden: usize,
    ffn: usize,
    /// A rank whose load fails, to test that the group names it.
    fail_rank: Option<usize>,
    store: Option<Arc<SafetensorsStore>>,
    /// Loads begun, over all ranks.
    loads: Arc<AtomicUsize>,
    /// Calls of `Family::shards` and of `check`.
    splits: Arc<AtomicUsize>,
    checks: Arc<AtomicUsize>,
}

#[derive(Clone)]
struct ToyShard {
    cols: std::ops::Range<usize>,
    decls: Vec<WeightDecl>,
}

struct ToyRank {
    up: ColumnParallelLinear,
    down: RowParallelLinear,
    bytes: usize,
}

impl ToyMlp {
    fn decls(&self, cols: std::ops::Range<usize>) -> Vec<WeightDecl> {
        let mut decls = ColumnParallelLinear::decls("up", self.hidden, self.ffn, cols.clone(), true);
        decls.extend(RowParallelLinear::decls("down", self.ffn, self.hidden, cols, true));
        decls
    }
}

impl ShardedModel for ToyMlp {
    fn name(&self) -> &str {
        &self.name
    }
    fn max_tp(&self) -> usize {
        self.ffn
    }
    fn default_dtype(&self) -> DType {
        DType::F32
    }
    fn default_placement(&self) -> Placement {
        Placement::llm(16, 1)
    }
    fn max_context(&self) -> Option<usize> {
        Some(1 << 20)
    }
    fn rank_shards(&self, tp: usize) -> Result<Vec<Box<dyn RankShard>>, PlanError> {
        Ok(boxed_shards(self.shards(tp)?))
    }
    fn check(&self, decls: &[WeightDecl]) -> Result<(), PlanError> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        match &self.store {
            Some(store) => ShardLoader::check(&**store, decls, &|_| false).map_err(|e| PlanError::Model(e.to_string())),
            None => Ok(()),
        }
    }
    fn fsdp_unit(&self, _tensor: &str) -> Option<String> {
        Some("mlp".into())
    }
}

impl RankShard for ToyShard {
    fn weight_decls(&self) -> &[WeightDecl] {
        &self.decls
    }
    /// One forward of `max_context` rows: the hidden layer's columns and the f32 output.
    fn footprint(&self, dtype: DType, placement: Placement, _: Accelerator) -> Result<Footprint, PlanError> {
        let Placement::Llm { max_context, batch, .. } = placement else {
            return Err(PlanError::Placement("the toy takes --max-context".into()));
        };
        let rows = (max_context * batch) as u64;
        let hidden = self.decls[2].shape[0] as u64;
        Ok(Footprint {
            activations: rows * (self.cols.len() as u64 * dtype.size_in_bytes() as u64 + hidden * 4),
            tokens_per_forward: max_context,
            ..Footprint::default()
        })
    }
}

impl Family for ToyMlp {
    const NAME: &'static str = "toy-mlp";
    const PRESETS: &'static [&'static str] = &["toy-mlp-wide"];
    type Shard = ToyShard;
    type Rank = ToyRank;

    fn detect(path: &Path) -> bool {
        path.join("toy.json").is_file()
    }

    fn open(path: &Path) -> Result<Self, PlanError> {
        let text = std::fs::read_to_string(path.join("toy.json")).map_err(|e| PlanError::Model(e.to_string()))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| PlanError::Model(e.to_string()))?;
        let field = |name: &str| json[name].as_u64().map(|v| v as usize);
        let store = SafetensorsStore::open(path).map_err(|e| PlanError::Model(e.to_string()))?;
        Ok(Self {
            name: path.display().to_string(),
            hidden: field("hidden").ok_or_else(|| PlanError::Model("toy.json: no `hidden`".into()))?,
            ffn: field("ffn").ok_or_else(|| PlanError::Model("toy.json: no `ffn`".into()))?,
            fail_rank: field("fail_rank"),
            store: Some(Arc::new(store)),
            loads: Arc::default(),
            splits: Arc::default(),
            checks: Arc::default(),
        })
    }

    fn preset(name: &str) -> Option<Self> {
        (name == "toy-mlp-wide").then(|| Self {
            name: name.into(),
            hidden: 4096,
            ffn: 1 << 20,
            fail_rank: None,
            store: None,
            loads: Arc::default(),
            splits: Arc::default(),
            checks: Arc::default(),
        })
    }

    fn shards(&self, tp: usize) -> Result<Vec<ToyShard>, PlanError> {
        self.splits.fetch_add(1, Ordering::SeqCst);
        if tp == 0 || tp > self.ffn {
            return Err(PlanError::Sharding {
                tp,
                detail: format!("the toy's {} FFN columns split 1 to {} ways", self.ffn, self.ffn),
            });
        }
        split_evenly(self.ffn, tp)
            .into_iter()
            .map(|cols| {
                let decls = self.decls(cols.clone());
                Ok(ToyShard { cols, decls })
            })
            .collect()
    }

    fn load(
        &self,
        shard: &ToyShard,
        _placement: Placement,
        ctx: &LoadContext<'_>,
    ) -> Result<ToyRank, tpinfer_layers::Error> {
        self.loads.fetch_add(1, Ordering::SeqCst);
        if self.fail_rank == Some(ctx.comm.rank()) {
            return Err(tpinfer_layers::Error::Shard("the toy's load failed on purpose".into()));
        }
        let store = self
            .store
            .as_deref()
            .ok_or_else(|| tpinfer_layers::Error::Shard("a preset has no weights".into()))?;
        let mut w = ShardLoader::new(store as &dyn WeightStore, &shard.decls, ctx.dtype, ctx.device);
        let up = ColumnParallelLinear::load(&mut w, "up", true)?;
        let down = RowParallelLinear::load(&mut w, "down", true, ctx.comm.clone())?;
        Ok(ToyRank {
            up,
            down,
            bytes: w.bytes_read(),
        })
    }

    fn bytes_loaded(rank: &ToyRank) -> usize {
        rank.bytes
    }
}

/// Writes a toy model of `hidden` × `ffn` with seeded weights; returns its weights.
fn write_toy(dir: &Path, hidden: usize, ffn: usize, fail_rank: Option<usize>) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut seed = 12345u64;
    let mut values = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((seed >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 0.5
            })
            .collect()
    };
    let tensors = vec![
        ("up.weight".to_string(), vec![ffn, hidden], values(ffn * hidden)),
        ("up.bias".to_string(), vec![ffn], values(ffn)),
        ("down.weight".to_string(), vec![hidden, ffn], values(hidden * ffn)),
        ("down.bias".to_string(), vec![hidden], values(hidden)),
    ];
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), data)| {
            (
                name.clone(),
                TensorView::new(Dtype::F32, shape.clone(), data).expect("view"),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).expect("write");
    let config = serde_json::json!({"hidden": hidden, "ffn": ffn, "fail_rank": fail_rank});
    std::fs::write(dir.join("toy.json"), config.to_string()).expect("toy.json");
    tensors
}

fn tensor(values: &[(String, Vec<usize>, Vec<f32>)], name: &str) -> Tensor {
    let (_, shape, data) = values.iter().find(|(n, _, _)| n == name).expect("tensor");
    Tensor::from_slice(data, shape.as_slice(), &Device::Cpu).expect("tensor")
}

/// The toy on `tp` CPU ranks.
fn start(
    model: ToyMlp,
    tp: usize,
    options: GroupOptions,
) -> Result<(tpinfer_runtime::RankGroup, ToyHandle), RuntimeError> {
    let mut launch = Launch::new(Topology::new(tp, &DeviceKind::Cpu)?, options);
    let placement = model.default_placement();
    let handle = launch.add(Arc::new(model), DType::F32, placement)?;
    Ok((launch.start()?, handle))
}

type ToyHandle = tpinfer_runtime::ModelHandle<ToyRank>;

#[test]
fn the_planner_plans_a_family_it_does_not_know() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_toy(dir.path(), 8, 30, None);
    let model = ToyMlp::open(dir.path()).expect("open");
    assert!(ToyMlp::detect(dir.path()));
    let placement = model.default_placement();
    let plan = Plan::new(&model, 3, DType::F32, placement, DeviceProfile::cpu()).expect("plan");
    // Each rank: 10 columns of up (weight and bias), 10 rows of down's input, down's bias.
    for rank in &plan.ranks {
        assert_eq!(rank.weights, ((10 * 8 + 10) + 8 * 10 + 8) * 4, "rank {}", rank.rank);
        assert_eq!(rank.activations, 16 * (10 * 4 + 8 * 4));
    }
    assert_eq!(plan.tokens_per_forward, 16);
    assert_eq!(plan.fsdp.largest_unit, "mlp");
    assert_eq!(plan.fsdp.unshard_buffer, ((30 * 8 + 30) + 8 * 30 + 8) * 4);
    let err = Plan::new(&model, 31, DType::F32, placement, DeviceProfile::cpu()).expect_err("31 > 30 columns");
    assert!(err.to_string().contains("30 FFN columns"), "{err}");
    let video = Placement::Dit {
        frames: 81,
        width: 832,
        height: 480,
        cfg: true,
    };
    let err = Plan::new(&model, 1, DType::F32, video, DeviceProfile::cpu()).expect_err("not a DiT");
    assert!(err.to_string().contains("--max-context"), "{err}");

    // What fits: the preset's 32 GiB of weights on 24 GiB GPUs needs a second rank.
    let wide = ToyMlp::preset("toy-mlp-wide").expect("preset");
    let budget = 24u64 << 30;
    let one = Plan::new(&wide, 1, DType::F32, placement, DeviceProfile::cuda()).expect("plan");
    assert!(!one.fits(budget), "{:?}", one.peak());
    let message = over_budget_message(&wide, &one, DType::F32, budget);
    assert!(message.contains("fits with --tp 2"), "{message}");
    let table = fit_table(&wide, DType::F32, placement, DeviceProfile::cuda(), budget, 1..=3);
    assert_eq!(table.iter().map(|w| w.fits).collect::<Vec<_>>(), [false, true, true]);
    assert!(table[1].max_context.is_some_and(|c| c > 16));
}

#[test]
fn the_rank_group_runs_a_family_it_does_not_know_at_tp_1_to_4() {
    let dir = tempfile::tempdir().expect("tempdir");
    let weights = write_toy(dir.path(), 12, 36, None);
    // The unsharded reference, from the same weights.
    let x = Tensor::arange(0f32, 5.0 * 12.0, &Device::Cpu)
        .and_then(|t| t.reshape((5, 12)))
        .and_then(|t| t.affine(0.02, -0.5))
        .expect("x");
    let linear = |x: &Tensor, w: &str, b: &str| {
        x.matmul(&tensor(&weights, w).t().expect("t"))
            .and_then(|y| y.broadcast_add(&tensor(&weights, b)))
            .expect("linear")
    };
    let reference = linear(
        &linear(&x, "up.weight", "up.bias").relu().expect("relu"),
        "down.weight",
        "down.bias",
    );
    for tp in 1..=4 {
        let model = ToyMlp::open(dir.path()).expect("open");
        let (loads, splits, checks) = (model.loads.clone(), model.splits.clone(), model.checks.clone());
        let (group, handle) = start(model, tp, GroupOptions::default()).expect("start");
        assert_eq!(loads.load(Ordering::SeqCst), tp, "one load per rank");
        // Split once for the ranks (and once, unchecked, for the FSDP comparison); each
        // rank's tensors checked against the checkpoint once.
        assert_eq!(splits.load(Ordering::SeqCst), 2, "TP {tp}");
        assert_eq!(checks.load(Ordering::SeqCst), tp, "TP {tp}");
        let planned: Vec<usize> = group.plans()[0].ranks.iter().map(|r| r.weights as usize).collect();
        assert_eq!(
            group.weight_bytes(handle.index()),
            planned,
            "TP {tp}: read what was planned"
        );
        let input = x.clone();
        let outputs = group
            .run(move |rank| -> Result<Tensor, RuntimeError> {
                let toy = rank.models.get_mut(&handle)?;
                let err = |e| RuntimeError::of_rank(rank.env.rank, e);
                let h = toy.up.forward(&input).map_err(err)?.relu().map_err(|e| err(e.into()))?;
                toy.down.forward(&h).map_err(err)
            })
            .expect("forward");
        assert_eq!(outputs.len(), tp);
        for (rank, out) in outputs.iter().enumerate() {
            let rel = tensor_rel_error(out, &reference);
            assert!(rel < 1e-6, "TP {tp} rank {rank}: rel {rel:e}");
        }
    }
}

#[test]
fn a_rank_that_fails_to_load_is_named_by_the_group() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_toy(dir.path(), 8, 24, Some(2));
    let model = ToyMlp::open(dir.path()).expect("open");
    let err = start(model, 3, GroupOptions::default()).err().expect("rank 2 fails");
    assert!(!err.is_peer_report(), "the cause, not a peer's report: {err}");
    let text = err.to_string();
    assert!(text.contains("rank 2") && text.contains("on purpose"), "{text}");
}

#[test]
fn a_group_over_budget_is_refused_before_any_rank_loads() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_toy(dir.path(), 8, 24, None);
    let model = ToyMlp::open(dir.path()).expect("open");
    let loads = model.loads.clone();
    let options = GroupOptions {
        gpu_mem: Some(1000),
        ..GroupOptions::default()
    };
    match start(model, 2, options) {
        Err(RuntimeError::OverBudget(message)) => assert!(message.contains("rank 0 needs"), "{message}"),
        Err(e) => panic!("expected an over-budget refusal, got {e}"),
        Ok(_) => panic!("1000 bytes cannot hold the toy"),
    }
    assert_eq!(loads.load(Ordering::SeqCst), 0, "refused before any load");
}

/// CPU ranks share the host's memory: a group whose ranks together need more than it has is
/// refused before any load, and no "per GPU" or "add GPUs" advice is given for them.
#[test]
fn cpu_ranks_are_held_to_the_hosts_memory() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_toy(dir.path(), 8, 24, None);
    let model = ToyMlp::open(dir.path()).expect("open");
    let loads = model.loads.clone();
    let mut launch = Launch::new(
        Topology::new(2, &DeviceKind::Cpu).expect("topology"),
        GroupOptions::default(),
    );
    // 2^34 rows of activations: terabytes, more than any host has.
    let placement = Placement::llm(1 << 34, 1);
    launch.add(Arc::new(model), DType::F32, placement).expect("planned");
    match launch.start() {
        Err(RuntimeError::OverBudget(message)) => {
            assert!(
                message.contains("CPU ranks") && message.contains("MemAvailable"),
                "{message}"
            );
            assert!(!message.contains("GPU"), "{message}");
        }
        Err(e) => panic!("expected the host's memory to refuse it, got {e}"),
        Ok(_) => panic!("terabytes cannot fit the host"),
    }
    assert_eq!(loads.load(Ordering::SeqCst), 0, "refused before any load");
    let tight = GroupOptions {
        gpu_mem: Some(1000),
        ..GroupOptions::default()
    };
    let model = ToyMlp::open(dir.path()).expect("open");
    let placement = model.default_placement();
    let mut launch = Launch::new(Topology::new(2, &DeviceKind::Cpu).expect("topology"), tight);
    launch.add(Arc::new(model), DType::F32, placement).expect("planned");
    let message = launch.start().err().expect("over budget").to_string();
    assert!(
        message.contains("per CPU rank") && !message.contains("GPU"),
        "{message}"
    );
}
