//! The activation model (`tpinfer_llama::memory`) against the bytes a forward really allocates,
//! counted by this test binary's global allocator: CPU tensors are heap allocations, and
//! candle allocates a tensor's storage the same way on every device.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device};
use tpinfer_comm::ThreadGroup;
use tpinfer_llama::memory::RankMemory;
use tpinfer_llama::{LlamaCheckpoint, LlamaRank, LlamaShard};
use tpinfer_tests::{Flavor, TinyLlama};

struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; only sizes are counted.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let now = CURRENT.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
        PEAK.fetch_max(now, Ordering::SeqCst);
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        CURRENT.fetch_sub(layout.size(), Ordering::SeqCst);
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let now = CURRENT.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
        PEAK.fetch_max(now, Ordering::SeqCst);
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // Counted as a new block alongside the old one, as a copying realloc holds both.
        let now = CURRENT.fetch_add(new_size, Ordering::SeqCst) + new_size;
        PEAK.fetch_max(now, Ordering::SeqCst);
        CURRENT.fetch_sub(layout.size(), Ordering::SeqCst);
        // SAFETY: `ptr` came from this allocator with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `f` on a one-thread rayon pool: the CPU GEMM keeps a packing buffer per worker
/// thread, so with more workers a measured forward could be the first GEMM on some thread
/// and count its buffer as an activation.
fn single_thread<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("thread pool")
        .install(f)
}

/// The counter is process-wide: tests that measure take turns.
static MEASURING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The peak bytes allocated on top of what is live when `f` starts.
fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = CURRENT.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    let out = f();
    (out, PEAK.load(Ordering::SeqCst) - base)
}

/// A full-context prompt at TP 1, whole and in chunks, in f32 and bf16, through the unfused
/// attention and the flash kernel's CPU twin: the measured activation peak is the modelled one
/// within 3%. A third score buffer alive at once, or a copied KV cache, would
/// miss by far more.
#[test]
fn forward_allocates_what_the_activation_model_says() {
    let _turn = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    // Qwen3's per-head Q/K norms add their own temporaries.
    for flavor in [Flavor::Llama, Flavor::Qwen3] {
        forward_against_the_activation_model(TinyLlama {
            heads: 8,
            kv_heads: 4,
            flavor,
            ..TinyLlama::default()
        });
    }
}

fn forward_against_the_activation_model(model: TinyLlama) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(dir.path());
    let checkpoint = LlamaCheckpoint::open(&path).expect("open");
    let context = 512;
    let prompt: Vec<u32> = (0..context as u32)
        .map(|i| (i * 37 + 11) % model.vocab as u32)
        .collect();
    for (dtype, chunk, flash) in [
        (DType::F32, 512, false),
        (DType::F32, 128, false),
        (DType::BF16, 512, false),
        (DType::BF16, 128, false),
        // Not the flash path in bf16: candle's CPU matmul works in f32 scratch buffers there,
        // which the score buffers hide but which would dominate without them (cuBLAS has
        // none; the H200 check is in benches/RESULTS.md).
        (DType::F32, 512, true),
        (DType::F32, 128, true),
    ] {
        let comm = ThreadGroup::ranks(1, std::time::Duration::from_secs(30)).remove(0);
        let shard = LlamaShard::new(&checkpoint.config, 1, 0).expect("shard");
        let mut rank =
            LlamaRank::load(&checkpoint, shard.clone(), Arc::new(comm), dtype, &Device::Cpu, context).expect("load");
        rank.set_prefill_chunk(chunk);
        rank.set_flash_attention(flash).expect("whole GQA groups");
        let expected = RankMemory::new(&checkpoint.config, &shard, dtype, context, chunk, flash).activations;
        // A first forward lets the CPU GEMM allocate its packing buffers, which it keeps: the
        // workspace the plan counts apart (cuBLAS's on GPUs), not activations.
        drop(rank.forward(&prompt).expect("warm-up"));
        rank.clear_cache();
        let (logits, measured) = peak_during(|| rank.forward(&prompt).expect("forward"));
        drop(logits);
        assert_close(
            measured,
            expected,
            &format!("{:?} {dtype:?} chunk {chunk} flash {flash}, full context", model.flavor),
        );
        // A shorter request: the model of that request, as the engine checks it at run time.
        rank.clear_cache();
        let short = &prompt[..300];
        let expected = rank.planned_activations(short.len(), short.len()).peak;
        let (logits, measured) = peak_during(|| rank.forward(short).expect("forward"));
        drop(logits);
        assert_close(
            measured,
            expected,
            &format!(
                "{:?} {dtype:?} chunk {chunk} flash {flash}, 300 positions",
                model.flavor
            ),
        );
    }
}

fn assert_close(measured: usize, expected: usize, case: &str) {
    let off = measured as f64 / expected as f64 - 1.0;
    assert!(
        off.abs() < 0.03,
        "{case}: measured {measured} bytes, modelled {expected} ({:+.1}%)",
        100.0 * off
    );
}

/// A Wan DiT's only rank on the CPU, in f32, its weights as stored.
fn wan_rank_f32(
    config: &tpinfer_wan::WanConfig,
    store: &dyn tpinfer_weights::WeightStore,
    shard: &tpinfer_wan::WanShard,
) -> tpinfer_wan::WanRank {
    wan_rank_f32_as(config, store, shard, tpinfer_weights::WeightFormat::AsStored)
}

/// A Wan DiT's only rank on the CPU, in f32, its weights in `format`.
fn wan_rank_f32_as(
    config: &tpinfer_wan::WanConfig,
    store: &dyn tpinfer_weights::WeightStore,
    shard: &tpinfer_wan::WanShard,
    format: tpinfer_weights::WeightFormat,
) -> tpinfer_wan::WanRank {
    let comm = ThreadGroup::ranks(1, std::time::Duration::from_secs(30)).remove(0);
    tpinfer_wan::WanRank::load(
        config,
        store,
        shard.clone(),
        format,
        Arc::new(comm),
        DType::F32,
        &Device::Cpu,
    )
    .expect("load")
}

/// The Wan DiT's forward against `tpinfer_wan::memory` at TP 1 in f32: the measured peak is
/// the modelled RoPE tables plus activations within 3%. A block that kept its Q projection
/// or K/V output alive a stage longer, or a norm that left an f32 copy, would miss by more.
/// (Not bf16 on CPU: candle's CPU GEMM converts 16-bit operands to f32 copies, which cuBLAS
/// does not; the bf16 model is checked on the GPU host, benches/RESULTS.md.) 768 tokens: the
/// CPU GEMM packs its weight for each call (the gemm crate's scratch, some k × n values, which
/// the model leaves to the device as it leaves cuBLASLt's workspace), and with fewer tokens
/// that scratch outgrew the residual update after the FFN's down projection.
#[test]
fn dit_forward_allocates_what_the_memory_model_says() {
    dit_forward_against_the_memory_model(tpinfer_weights::WeightFormat::AsStored, 384);
}

/// The same with FP8 weights (`--quantize fp8`), which CPU ranks expand product by product:
/// each product's expanded weight is counted in the phase it runs in, not beside the block's
/// peak. With an FFN of 384 the peak is the projections', after their products (an expanded
/// weight beside it would be 16% over); with 1,024 it is the FFN's up product (its expanded
/// weight left out, 21% under).
#[test]
fn dit_fp8_forward_allocates_what_the_memory_model_says() {
    dit_forward_against_the_memory_model(tpinfer_weights::WeightFormat::Fp8, 384);
    dit_forward_against_the_memory_model(tpinfer_weights::WeightFormat::Fp8, 1024);
}

fn dit_forward_against_the_memory_model(format: tpinfer_weights::WeightFormat, ffn: usize) {
    let _turn = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    use tpinfer_tests::{open_wan, wan_inputs, TinyWan};
    use tpinfer_wan::memory::{DitMemory, ForwardPath, LinearWeights, Video};
    use tpinfer_wan::WanShard;

    let model = TinyWan {
        heads: 4,
        head_dim: 32,
        ffn,
        ..TinyWan::default()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    model.write(dir.path());
    let (config, store) = open_wan(dir.path());
    let (frames, height, width) = (3, 32, 32);
    let (latents, text) = wan_inputs(&model, frames, height, width, 5);
    let video = Video {
        frames: (frames - 1) * 4 + 1,
        width: width * 8,
        height: height * 8,
        cfg: true,
    };
    let dtype = DType::F32;
    let shard = WanShard::new(&config, 1, 0).expect("shard");
    let measured = single_thread(|| {
        let rank = wan_rank_f32_as(&config, &*store, &shard, format);
        let context = rank.embed_text(&text).expect("text");
        drop(rank.forward(&latents, 700.0, &context).expect("warm-up"));
        let (velocity, measured) = peak_during(|| rank.forward(&latents, 700.0, &context).expect("forward"));
        drop(velocity);
        measured
    });
    let weights = match format {
        tpinfer_weights::WeightFormat::Fp8 => LinearWeights::Fp8 { tensor_cores: false },
        _ => LinearWeights::Dense,
    };
    let m = DitMemory::with_text(
        &config,
        &shard,
        dtype,
        video,
        text.dim(0).expect("tokens"),
        ForwardPath::for_device(false, dtype, config.attention_head_dim).with_linear_weights(weights),
    );
    assert_close(
        measured,
        m.buffers + m.activations,
        &format!("DiT {dtype:?} {format:?}"),
    );
}

/// Wan2.2-S2V's forward (the tiny checkpoint of `tests/fixtures/s2v-dit`, its clip with the
/// motion frames prepared beforehand, as the pipeline holds it for all the clip's steps)
/// against `tpinfer_wan::memory` at TP 1 in f32: the measured peak is the modelled
/// activations within 3%; the RoPE table and the clip's tokens are the clip's, outside it.
#[test]
fn s2v_forward_allocates_what_the_memory_model_says() {
    let _turn = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    use tpinfer_wan::memory::{DitMemory, ForwardPath, Video};
    use tpinfer_wan::{S2vCondition, WanCheckpoint, WanShard};

    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/s2v-dit");
    let checkpoint = WanCheckpoint::open(&fixture.join("model")).expect("open");
    let inputs = candle_core::safetensors::load(fixture.join("inputs.safetensors"), &Device::Cpu).expect("inputs");
    let config = &checkpoint.config;
    let dtype = DType::F32;
    let shard = WanShard::new(config, 1, 0).expect("shard");
    let (measured, video) = single_thread(|| {
        let rank = wan_rank_f32(config, &*checkpoint.store, &shard);
        let context = rank.embed_text(&inputs["text"]).expect("text");
        let noisy = &inputs["noisy"];
        let condition = S2vCondition {
            reference: inputs["reference"].clone(),
            motion: Some(inputs["motion"].clone()),
            pose: inputs["pose"].clone(),
            audio: rank.encode_s2v_audio(&inputs["audio"]).expect("audio"),
        };
        let clip = rank.prepare_s2v(noisy.dims(), &condition).expect("prepare");
        drop(rank.forward_s2v(noisy, 700.0, &context, &clip, None).expect("warm-up"));
        let (velocity, measured) =
            peak_during(|| rank.forward_s2v(noisy, 700.0, &context, &clip, None).expect("forward"));
        drop(velocity);
        let (_, frames, height, width) = noisy.dims4().expect("latents");
        let video = Video {
            frames: frames * 4,
            width: width * 8,
            height: height * 8,
            cfg: true,
        };
        (measured, video)
    });
    let m = DitMemory::with_text(
        config,
        &shard,
        dtype,
        video,
        inputs["text"].dim(0).expect("tokens"),
        ForwardPath::for_device(false, dtype, config.attention_head_dim),
    );
    assert_close(measured, m.activations, "S2V f32");
}

/// The umT5 encoder's `encode` against `tpinfer_umt5::memory` at TP 1 in f32: the measured
/// peak is the modelled one within 3%. A layer that kept a second set of f32 score buffers
/// alive, or a bias gathered per query, would miss by more.
#[test]
fn umt5_encode_allocates_what_the_memory_model_says() {
    let _turn = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    use tpinfer_tests::TinyUmt5;
    use tpinfer_umt5::memory::EncodeMemory;
    use tpinfer_umt5::{Umt5Config, Umt5Rank, Umt5Shard};

    let model = TinyUmt5 {
        d_model: 64,
        d_kv: 16,
        heads: 4,
        d_ff: 96,
        ..TinyUmt5::default()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    model.write(dir.path());
    let config = Umt5Config::from_dir(dir.path()).expect("config");
    let store = tpinfer_weights::SafetensorsStore::open(dir.path()).expect("store");
    let ids: Vec<u32> = (0..160).map(|i| (i * 37 + 5) % model.vocab as u32).collect();
    let shard = Umt5Shard::new(&config, 1, 0).expect("shard");
    let dtype = DType::F32;
    let measured = single_thread(|| {
        let comm = ThreadGroup::ranks(1, std::time::Duration::from_secs(30)).remove(0);
        let rank = Umt5Rank::load(
            &config,
            &store,
            &shard,
            tpinfer_weights::WeightFormat::AsStored,
            Arc::new(comm),
            dtype,
            &Device::Cpu,
        )
        .expect("load");
        drop(rank.encode(&ids).expect("warm-up"));
        let (states, measured) = peak_during(|| rank.encode(&ids).expect("encode"));
        drop(states);
        measured
    });
    let expected = EncodeMemory::new(&config, &shard, dtype, ids.len()).peak;
    assert_close(measured, expected, "umT5 f32");
}

/// The Wan VAE's decode against `tpinfer_wan_vae::memory` in f32 on CPU ranks, whole and in
/// tiles, on a band and on the whole frame: the measured peak is the modelled one within 3%.
/// A frame cache that kept a view of all the frames it read (it once held each call's whole
/// input, 40% more), or a window kept as a view of its frame, would miss by far more.
#[test]
fn vae_decode_allocates_what_the_memory_model_says() {
    let _turn = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    use tpinfer_tests::{vae_latents, TinyWanVae};
    use tpinfer_wan_vae::memory::{DecodeDevice, DecodeMemory, DecodeShape, Tiling};
    use tpinfer_wan_vae::{WanVaeConfig, WanVaeRank, WanVaeShard};

    let model = TinyWanVae {
        base_dim: 16,
        ..TinyWanVae::default()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    model.write(dir.path());
    let config = WanVaeConfig::from_dir(dir.path()).expect("config");
    let store = tpinfer_weights::SafetensorsStore::open(dir.path()).expect("store");
    let latents = vae_latents(model.z_dim, 3, 8, 10, 3);
    let video = DecodeShape {
        latent_frames: 3,
        height: 64,
        width: 80,
    };
    let device = DecodeDevice {
        dtype: DType::F32,
        cuda: false,
        conv: tpinfer_wan_vae::memory::ConvPath::Taps,
    };
    for (tp, rank, rows, frames) in [(1, 0, 64, 4), (1, 0, 16, 4), (3, 1, 8, 2), (2, 1, 32, 1), (1, 0, 64, 1)] {
        let tile = Tiling { rows, frames };
        let shard = WanVaeShard::new(tp, rank).expect("shard");
        let band = shard.band(&config, 64).expect("band");
        let measured = single_thread(|| {
            let vae = WanVaeRank::load(&config, &store, shard, DType::F32, &Device::Cpu).expect("load");
            drop(vae.decode(&latents, Some(tile), &mut |_, _| {}).expect("warm-up"));
            let (pixels, measured) = peak_during(|| vae.decode(&latents, Some(tile), &mut |_, _| {}).expect("decode"));
            drop(pixels);
            measured
        });
        let expected = DecodeMemory::with_tiling(&config, device, video, band, tile).peak;
        assert_close(measured, expected, &format!("VAE TP {tp} rank {rank}, {tile:?}"));
    }
}

/// The wav2vec2 encoder against `tpinfer_wav2vec2::memory` in f32 on CPU ranks: the
/// fixture's (its feature convolutions the peak) in one pass and in windows, and a wider one
/// whose layers are the peak. The measured peak is the modelled one within 3%. A shadowed
/// temporary kept to the end of its function (the first draft held the projection's input
/// and the positional convolution's output so), or states gathered and then stacked, would
/// miss by far more.
#[test]
fn wav2vec2_encode_allocates_what_the_memory_model_says() {
    let _turn = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    use tpinfer_wav2vec2::memory::EncodeMemory;
    use tpinfer_wav2vec2::{Names, Wav2Vec2Config, Wav2Vec2Rank, Wav2Vec2Shard};

    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/wav2vec2-tiny");
    // The fixture's encoder 512 wide, its checkpoint random from the declarations.
    let wide = tempfile::tempdir().expect("tempdir");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("config.json")).expect("read")).expect("json");
    config["hidden_size"] = 512.into();
    config["num_attention_heads"] = 8.into();
    config["intermediate_size"] = 1024.into();
    std::fs::write(wide.path().join("config.json"), config.to_string()).expect("write");
    let wide_config = Wav2Vec2Config::from_dir(wide.path()).expect("config");
    let decls = Wav2Vec2Shard::new(&wide_config, 1, 0)
        .expect("shard")
        .weight_decls(&wide_config, &Names::ctc());
    let tensors: std::collections::HashMap<String, candle_core::Tensor> = decls
        .iter()
        .map(|d| {
            let t = candle_core::Tensor::randn(0f32, 0.05, d.shape.as_slice(), &Device::Cpu).expect("randn");
            (d.name.clone(), t)
        })
        .collect();
    candle_core::safetensors::save(&tensors, wide.path().join("model.safetensors")).expect("save");

    // Six seconds of a tone: 299 frames.
    let samples: Vec<f32> = (0..96_000).map(|i| (i as f32 * 0.05).sin()).collect();
    let dtype = DType::F32;
    for (dir, chunk) in [
        (fixture.as_path(), tpinfer_wav2vec2::FEATURE_CHUNK_FRAMES),
        (fixture.as_path(), 64),
        (wide.path(), tpinfer_wav2vec2::FEATURE_CHUNK_FRAMES),
    ] {
        let config = Wav2Vec2Config::from_dir(dir).expect("config");
        let store = tpinfer_weights::SafetensorsStore::open(dir).expect("store");
        let shard = Wav2Vec2Shard::new(&config, 1, 0).expect("shard");
        let measured = single_thread(|| {
            let comm = ThreadGroup::ranks(1, std::time::Duration::from_secs(30)).remove(0);
            let rank = Wav2Vec2Rank::load(&config, &store, &shard, Arc::new(comm), dtype, &Device::Cpu).expect("load");
            drop(rank.hidden_states_in_chunks(&samples, chunk).expect("warm-up"));
            let (states, measured) = peak_during(|| rank.hidden_states_in_chunks(&samples, chunk).expect("encode"));
            drop(states);
            measured
        });
        let frames = config.frames(samples.len());
        let expected = EncodeMemory::in_chunks(&config, &shard, dtype, frames, chunk).peak;
        assert_close(
            measured,
            expected,
            &format!("wav2vec2 {} wide, f32, {chunk}-frame windows", config.hidden_size),
        );
    }
}

/// The VAE encoder against `tpinfer_wan_vae::memory::EncodeMemory` in f32 on a CPU rank: a
/// video (the peak in a chunk of four frames with two of history a convolution) and an
/// image, at two base widths. The measured peak is the modelled one within 3%.
#[test]
fn vae_encode_allocates_what_the_memory_model_says() {
    let _turn = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    use tpinfer_wan_vae::memory::{ConvPath, DecodeDevice, EncodeMemory};
    use tpinfer_wan_vae::{WanVaeConfig, WanVaeEncoder};

    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/vae-encoder/model");
    let config = WanVaeConfig::from_dir(&fixture).expect("config");
    let store = tpinfer_weights::SafetensorsStore::open(&fixture).expect("store");
    let device = DecodeDevice {
        dtype: DType::F32,
        cuda: false,
        conv: ConvPath::Taps,
    };
    for (frames, height, width) in [(9, 32, 48), (1, 64, 48), (13, 48, 64)] {
        let pixels = candle_core::Tensor::rand(-1f32, 1f32, (3, frames, height, width), &Device::Cpu).expect("pixels");
        let measured = single_thread(|| {
            let encoder = WanVaeEncoder::load(&config, &store, DType::F32, &Device::Cpu).expect("load");
            drop(encoder.encode(&pixels).expect("warm-up"));
            let (latents, measured) = peak_during(|| encoder.encode(&pixels).expect("encode"));
            drop(latents);
            measured
        });
        let expected = EncodeMemory::new(&config, device, frames, height, width).peak;
        assert_close(
            measured,
            expected,
            &format!("VAE encoder, {frames} frames of {width}x{height}"),
        );
    }
}
