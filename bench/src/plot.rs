//! A hand-written SVG of the report's figures (issue #19): throughput per scenario
//! as horizontal bars, and the steady latency percentiles. No plotting dependency:
//! the picture is a few rectangles and labels.

use std::fmt::Write as _;

use crate::scenarios::Figure;

const WIDTH: f64 = 960.0;
const LABEL: f64 = 400.0;
const VALUE: f64 = 140.0;
const ROW: f64 = 22.0;
const BAR: f64 = 15.0;
const TITLE: f64 = 34.0;
const GAP: f64 = 18.0;

/// The SVG for `figures` (an empty panel is left out).
pub fn svg(figures: &[Figure]) -> String {
    let throughput: Vec<&Figure> = figures.iter().filter(|f| f.unit.ends_with("/s")).collect();
    let latency: Vec<&Figure> = figures
        .iter()
        .filter(|f| {
            f.unit == "ms" && f.scenario.starts_with("steady") && f.scenario.contains("latency")
        })
        .collect();
    let mut body = String::new();
    let mut y = 0.0;
    if !throughput.is_empty() {
        y = panel(
            &mut body,
            y,
            "Throughput (higher is better; compare within one run)",
            &throughput,
        );
    }
    if !latency.is_empty() {
        y = panel(
            &mut body,
            y + GAP,
            "Steady commit → receive latency, ms (lower is better)",
            &latency,
        );
    }
    let height = y + 10.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r#"<rect width="{WIDTH}" height="{height}" fill="white"/>"#
    );
    s.push_str(&body);
    s.push_str("</svg>\n");
    s
}

/// Draws one panel from `top`; returns its bottom.
fn panel(s: &mut String, top: f64, title: &str, figures: &[&Figure]) -> f64 {
    let _ = writeln!(
        s,
        r#"<text x="8" y="{}" font-size="14" font-weight="bold">{}</text>"#,
        top + 22.0,
        escape(title)
    );
    let max = figures
        .iter()
        .map(|f| f.value)
        .filter(|v| v.is_finite())
        .fold(0.0_f64, f64::max);
    let span = WIDTH - LABEL - VALUE - 16.0;
    let mut y = top + TITLE;
    for f in figures {
        let len = if max > 0.0 && f.value.is_finite() {
            (f.value / max * span).max(1.0)
        } else {
            0.0
        };
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
            LABEL - 6.0,
            y + BAR - 3.0,
            escape(&f.scenario)
        );
        let _ = writeln!(
            s,
            r#"<rect x="{LABEL}" y="{y}" width="{len:.1}" height="{BAR}" fill="{}"><title>{}: {:.2} {}</title></rect>"#,
            colour(&f.scenario),
            escape(&f.scenario),
            f.value,
            escape(&f.unit)
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{}">{} {}</text>"#,
            LABEL + len + 6.0,
            y + BAR - 3.0,
            number(f.value),
            escape(&f.unit)
        );
        y += ROW;
    }
    y
}

/// Baselines grey, the reader orange, the relay to a queue blue, to a stream green.
fn colour(scenario: &str) -> &'static str {
    if scenario.starts_with("stream drain") {
        "#2e8b57"
    } else if scenario.starts_with("drain") || scenario.starts_with("steady") {
        "#3b6fb6"
    } else if scenario.starts_with("reader") {
        "#e08a2c"
    } else {
        "#8c8c8c"
    }
}

/// `12345.6` → `12,346`; small values keep two decimals.
fn number(v: f64) -> String {
    if !v.is_finite() {
        return v.to_string();
    }
    if v.abs() < 100.0 {
        return format!("{v:.2}");
    }
    let digits = format!("{:.0}", v.abs());
    let mut out = String::new();
    for (k, c) in digits.chars().enumerate() {
        if k > 0 && (digits.len() - k) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if v < 0.0 {
        out.insert(0, '-');
    }
    out
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The figures of a report's markdown table (`| figure | value | unit | conditions |`),
/// e.g. of a docs/benchmarks.md merged from several runs.
pub fn parse_markdown(text: &str) -> Vec<Figure> {
    text.lines()
        .take_while(|l| !l.starts_with("## "))
        .filter_map(|line| {
            let cells: Vec<&str> = line
                .strip_prefix('|')?
                .strip_suffix('|')?
                .split(" | ")
                .map(str::trim)
                .collect();
            let [scenario, value, unit, conditions] = cells.as_slice() else {
                return None;
            };
            Some(Figure {
                scenario: scenario.to_string(),
                value: value.parse().ok()?,
                unit: unit.to_string(),
                conditions: conditions.to_string(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn numbers_and_escapes() {
        assert_eq!(number(1234567.8), "1,234,568");
        assert_eq!(number(999.4), "999");
        assert_eq!(number(2.345), "2.35");
        assert_eq!(escape("a<b & \"c\">"), "a&lt;b &amp; &quot;c&quot;&gt;");
    }

    #[test]
    fn parses_the_report_table_and_draws_both_panels() {
        let md = "# Benchmarks\n\n| figure | value | unit | conditions |\n|---|---|---|---|\n\
                  | lapin raw publisher | 13661.27 | msgs/s | N=100000 |\n\
                  | steady latency p50 | 1.20 | ms | 1000 events/s |\n\
                  | drain 100-row tx: relay peak RSS | 57.79 | MB | N=100000 |\n\n\
                  ## Targets\n\n| target | measured | goal | status |\n|---|---|---|---|\n\
                  | steady p50 (ms) | 1.20 | ≤ 5 | met |\n";
        let figures = parse_markdown(md);
        let names: Vec<&str> = figures.iter().map(|f| f.scenario.as_str()).collect();
        assert_eq!(
            names,
            [
                "lapin raw publisher",
                "steady latency p50",
                "drain 100-row tx: relay peak RSS"
            ]
        );
        assert_eq!(figures[0].value, 13661.27);
        let svg = svg(&figures);
        assert!(svg.starts_with("<svg "), "{svg}");
        assert!(svg.contains(">13,661 msgs/s<"), "{svg}");
        assert!(svg.contains(">1.20 ms<"), "{svg}");
        assert!(!svg.contains("RSS"), "{svg}");
        assert_eq!(svg.matches("<rect ").count(), 3, "{svg}");
    }
}
