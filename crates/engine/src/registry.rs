//! The model families tpinfer knows, and what a directory or preset name holds. Adding a
//! family is one crate under `models/` and one line in [`families`].

use std::path::Path;
use std::sync::Arc;

use tpinfer_family::Family;
use tpinfer_llama::LlamaModel;
use tpinfer_plan::{PlanError, ShardedModel};
use tpinfer_umt5::Umt5Model;
use tpinfer_wan::{SelfAttention, WanModel};
use tpinfer_wan_vae::WanVaeModel;
use tpinfer_wav2vec2::Wav2Vec2Model;
use tpinfer_weights::WeightFormat;

/// What a family's models do, which decides the engine that runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// Text generation: [`crate::Engine`].
    Text,
    /// Video denoising: [`crate::VideoEngine`].
    Video,
    /// A text encoder: one stage of a video pipeline, planned and loaded on its ranks, not
    /// run alone.
    TextEncoder,
    /// A video VAE: the decode stage of a video pipeline (`tpinfer decode` runs it alone).
    VideoDecoder,
    /// A speech encoder: the audio stage of a speech-to-video pipeline, planned and loaded
    /// on its ranks, not run alone.
    SpeechEncoder,
}

/// One family as the registry lists it.
pub struct FamilyEntry {
    pub name: &'static str,
    pub task: Task,
    pub presets: &'static [&'static str],
    detect: fn(&Path) -> bool,
    open: fn(&Path, WeightFormat) -> Opened,
    preset: fn(&str, WeightFormat) -> Option<Opened>,
}

/// A model opened for planning, its weights in the form asked for.
type Opened = Result<Arc<dyn ShardedModel>, PlanError>;

impl FamilyEntry {
    fn of<F: Family>(task: Task) -> Self {
        Self {
            name: F::NAME,
            task,
            presets: F::PRESETS,
            detect: F::detect,
            open: |path, format| Ok(Arc::new(F::open(path)?.with_format(format)?) as Arc<dyn ShardedModel>),
            preset: |name, format| {
                F::preset(name).map(|m| Ok(Arc::new(m.with_format(format)?) as Arc<dyn ShardedModel>))
            },
        }
    }

    /// Whether `path` holds a model of this family.
    pub fn detects(&self, path: &Path) -> bool {
        (self.detect)(path)
    }
}

/// Every family, in the order directories are tried. The last is the default for a path no
/// family claims: its error then says what a model directory needs.
pub fn families() -> Vec<FamilyEntry> {
    vec![
        FamilyEntry::of::<WanModel>(Task::Video),
        FamilyEntry::of::<Umt5Model>(Task::TextEncoder),
        FamilyEntry::of::<WanVaeModel>(Task::VideoDecoder),
        FamilyEntry::of::<Wav2Vec2Model>(Task::SpeechEncoder),
        FamilyEntry::of::<LlamaModel>(Task::Text),
    ]
}

/// Every preset name, over all families.
pub fn presets() -> Vec<&'static str> {
    families().iter().flat_map(|f| f.presets.iter().copied()).collect()
}

/// The family of the model at `path`: the first that detects it, else the default.
pub fn family_of(path: &Path) -> FamilyEntry {
    let mut all = families();
    let default = all.len() - 1;
    let claimed = all.iter().position(|f| f.detects(path)).unwrap_or(default);
    all.swap_remove(claimed)
}

/// What the model or pipeline at `path` does: a Wan pipeline directory makes video, one
/// model's directory does what its family does.
pub fn task_of(path: &Path) -> Task {
    match crate::WanPipelineDir::detect(path) {
        true => Task::Video,
        false => family_of(path).task,
    }
}

/// A preset by name, or the model at a path, opened for planning (config and headers only),
/// with the task its family does.
pub fn open(name_or_path: &str) -> Result<(Task, Arc<dyn ShardedModel>), PlanError> {
    open_as(name_or_path, WeightFormat::AsStored)
}

/// A Wan DiT (a preset or a transformer directory) opened for planning, its linear weights in
/// `format` and its self-attention at `precision`; `None` when `name_or_path` is not one.
pub fn open_dit_as(
    name_or_path: &str,
    format: WeightFormat,
    precision: SelfAttention,
) -> Option<Result<Arc<dyn ShardedModel>, PlanError>> {
    let path = Path::new(name_or_path);
    let model = match WanModel::preset(name_or_path) {
        Some(model) => Ok(model),
        None if WanModel::detect(path) => WanModel::open(path),
        None => return None,
    };
    Some(
        model
            .and_then(|m| m.with_format(format))
            .map(|m| Arc::new(m.with_self_attention(precision)) as Arc<dyn ShardedModel>),
    )
}

/// [`open`], the model's linear weights planned in `format`.
pub fn open_as(name_or_path: &str, format: WeightFormat) -> Result<(Task, Arc<dyn ShardedModel>), PlanError> {
    for family in families() {
        if let Some(model) = (family.preset)(name_or_path, format) {
            return Ok((family.task, model?));
        }
    }
    let path = Path::new(name_or_path);
    if !path.exists() {
        return Err(PlanError::Model(format!(
            "{name_or_path} is neither a model path nor a preset; presets: {}",
            presets().join(", ")
        )));
    }
    if crate::WanPipelineDir::detect(path) {
        return Err(PlanError::Model(format!(
            "{name_or_path} is a pipeline directory, not one model: `tpinfer plan` plans its stages together"
        )));
    }
    let family = family_of(path);
    Ok((family.task, (family.open)(path, format)?))
}
