//! Writes a tiny random Wan text-to-video pipeline in diffusers' layout (`model_index.json`,
//! `tokenizer/`, `text_encoder/`, `transformer/`, `vae/`) into the folder given, for a CPU
//! smoke run of `tpinfer generate` (its frames are noise: the weights are random).
//!
//! ```sh
//! cargo run -p tpinfer-tests --example tiny_wan_pipeline -- target/tiny-wan
//! ```

fn main() {
    let Some(dir) = std::env::args_os().nth(1) else {
        eprintln!("usage: tiny_wan_pipeline DIR");
        std::process::exit(2);
    };
    let dir = tpinfer_tests::TinyWanPipeline::default().write(std::path::Path::new(&dir));
    println!("{}", dir.display());
}
