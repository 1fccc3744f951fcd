//! The sweep's plots, as SVG and PNG: DiT step time and speed-up against TP width, memory per
//! rank against frames; Llama decode tok/s and prefill time against TP width.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::sweep::Point;

type Series = Vec<(String, Vec<(f64, f64)>)>;

pub fn draw(points: &[Point], out: &Path) -> Result<()> {
    // PNG text needs a font in the process, not on the machine: egui's bundled Ubuntu Light.
    plotters::style::register_font("sans-serif", FontStyle::Normal, epaint_default_fonts::UBUNTU_LIGHT)
        .map_err(|_| anyhow!("the plot font did not load"))?;
    let mut step: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    let mut memory: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    let mut decode: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    let mut prefill: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for point in points {
        match point {
            Point::Dit {
                tp,
                frames,
                width,
                height,
                steps,
                step_ms,
                memory: ranks,
                ..
            } => {
                let label = format!("{frames} frames {width}x{height}, {steps} steps");
                step.entry(label).or_default().push((*tp as f64, step_ms.median));
                let fullest = |f: fn(&crate::sweep::RankMemory) -> Option<f64>| {
                    ranks
                        .iter()
                        .filter_map(f)
                        .fold(None, |a: Option<f64>, v| Some(a.map_or(v, |a| a.max(v))))
                };
                if let Some(planned) = fullest(|m| Some(m.planned_mib)) {
                    memory
                        .entry(format!("TP {tp} planned"))
                        .or_default()
                        .push((*frames as f64, planned));
                }
                if let Some(measured) = fullest(|m| m.measured_mib) {
                    memory
                        .entry(format!("TP {tp} measured"))
                        .or_default()
                        .push((*frames as f64, measured));
                }
            }
            Point::Llama {
                tp,
                prompt,
                new,
                prefill_ms,
                decode_tokens_per_s,
                ..
            } => {
                let label = format!("prompt {prompt}, {new} new");
                decode
                    .entry(label.clone())
                    .or_default()
                    .push((*tp as f64, decode_tokens_per_s.median));
                prefill.entry(label).or_default().push((*tp as f64, prefill_ms.median));
            }
        }
    }
    let series = |m: BTreeMap<String, Vec<(f64, f64)>>| -> Series {
        m.into_iter()
            .map(|(k, mut v)| {
                v.sort_by(|a, b| a.0.total_cmp(&b.0));
                (k, v)
            })
            .collect()
    };
    if !step.is_empty() {
        let step = series(step);
        // Speed-up against the narrowest width measured for the same video.
        let speedup: Series = step
            .iter()
            .map(|(k, v)| (k.clone(), v.iter().map(|&(tp, ms)| (tp, v[0].1 / ms)).collect()))
            .collect();
        line_chart(out, "dit_step_time", "DiT step time", "TP width", "ms per step", &step)?;
        line_chart(
            out,
            "dit_speedup",
            "DiT speed-up",
            "TP width",
            "× narrowest width",
            &speedup,
        )?;
        line_chart(
            out,
            "dit_memory",
            "DiT memory, fullest rank",
            "frames",
            "MiB",
            &series(memory),
        )?;
    }
    if !decode.is_empty() {
        line_chart(
            out,
            "llama_decode",
            "Llama decode",
            "TP width",
            "tokens/s",
            &series(decode),
        )?;
        line_chart(
            out,
            "llama_prefill",
            "Llama prefill",
            "TP width",
            "ms",
            &series(prefill),
        )?;
    }
    Ok(())
}

/// `{name}.svg` and `{name}.png` in `out`.
fn line_chart(out: &Path, name: &str, title: &str, x_desc: &str, y_desc: &str, series: &Series) -> Result<()> {
    let (svg, png) = (out.join(format!("{name}.svg")), out.join(format!("{name}.png")));
    let labels = (title, x_desc, y_desc);
    chart(SVGBackend::new(&svg, SIZE).into_drawing_area(), labels, series)
        .map_err(|e| anyhow!("plotting {}: {e}", svg.display()))?;
    // Drawn into memory and written by tpinfer-media's PNG encoder: plotters' own encoder
    // would bring a second `png` version (through `image` 0.24).
    let mut rgb = vec![0u8; SIZE.0 as usize * SIZE.1 as usize * 3];
    chart(
        BitMapBackend::with_buffer(&mut rgb, SIZE).into_drawing_area(),
        labels,
        series,
    )
    .map_err(|e| anyhow!("plotting {}: {e}", png.display()))?;
    let size = tpinfer_media::FrameSize {
        width: SIZE.0 as usize,
        height: SIZE.1 as usize,
    };
    let file = std::fs::File::create(&png).map_err(|e| anyhow!("writing {}: {e}", png.display()))?;
    tpinfer_media::write_png(std::io::BufWriter::new(file), size, &rgb)
        .map_err(|e| anyhow!("writing {}: {e}", png.display()))
}

const SIZE: (u32, u32) = (720, 440);

fn chart<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    (title, x_desc, y_desc): (&str, &str, &str),
    series: &Series,
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let xs = series.iter().flat_map(|(_, v)| v.iter().map(|p| p.0));
    let ys = series.iter().flat_map(|(_, v)| v.iter().map(|p| p.1));
    let (x_lo, x_hi) = xs.fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(x), hi.max(x)));
    let y_hi = ys.fold(0f64, f64::max);
    let x_pad = ((x_hi - x_lo) * 0.05).max(0.5);
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d(x_lo - x_pad..x_hi + x_pad, 0f64..(y_hi * 1.1).max(1e-9))
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        // TP widths and frame counts are whole numbers: label only those.
        .x_label_formatter(&|x| match x.fract() == 0.0 {
            true => format!("{x:.0}"),
            false => String::new(),
        })
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()
        .map_err(|e| err(&e))?;
    for (i, (label, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
