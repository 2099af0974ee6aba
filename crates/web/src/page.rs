//! The page's elements: text, the progress bar, the loss curve, errors.
//! Drawing never fails the computation: a missing element is reported
//! once on the page and the training goes on.

use crate::WebError;
use wasm_bindgen::{JsCast, JsValue};
use web_sys::{CanvasRenderingContext2d, Document, HtmlCanvasElement};

fn document() -> Option<Document> {
    web_sys::window()?.document()
}

/// Sets the text of element `id`.
pub fn set_text(id: &str, text: &str) {
    match document().and_then(|d| d.get_element_by_id(id)) {
        Some(e) => e.set_text_content(Some(text)),
        None => web_sys::console::warn_1(&WebError::Dom(id.into()).to_string().into()),
    }
}

/// Sets attribute `name` of element `id`.
pub fn set_attr(id: &str, name: &str, value: &str) {
    if let Some(e) = document().and_then(|d| d.get_element_by_id(id)) {
        let _ = e.set_attribute(name, value);
    }
}

/// Shows `message` in the page's error box (and the console).
pub fn error(message: &str) {
    web_sys::console::error_1(&message.into());
    if let Some(e) = document().and_then(|d| d.get_element_by_id("errors")) {
        let text = e.text_content().unwrap_or_default();
        e.set_text_content(Some(&format!("{text}{message}\n")));
        let _ = e.set_attribute("class", "errors shown");
    }
}

/// Shows an error result on the page; either way converts it for the
/// caller.
pub fn report(result: Result<serde_json::Value, WebError>) -> Result<serde_json::Value, JsValue> {
    result.map_err(|e| {
        error(&e.to_string());
        e.into()
    })
}

/// Shows a panic (a bug) on the page: the module is dead afterwards, but
/// the tab is not frozen and says what happened.
pub fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        error(&format!("panic (a bug in Lazuli): {info}"));
        // The module traps after the hook, and a promise it was driving
        // never settles: tell the page the run is over.
        if let Some(state) = web_sys::window().and_then(|w| js_sys::Reflect::get(&w, &"lazuli".into()).ok()) {
            let _ = js_sys::Reflect::set(&state, &"error".into(), &format!("panic: {info}").into());
            let _ = js_sys::Reflect::set(&state, &"done".into(), &true.into());
        }
    }));
}

/// Draws `losses` (one per step) as a polyline on canvas `id`, scaled to
/// its size, with the first and last values written beside it.
pub fn draw_curve(id: &str, losses: &[f32]) {
    let Some(canvas) =
        document().and_then(|d| d.get_element_by_id(id)).and_then(|e| e.dyn_into::<HtmlCanvasElement>().ok())
    else {
        return;
    };
    let Some(ctx) = canvas.get_context("2d").ok().flatten().and_then(|c| c.dyn_into::<CanvasRenderingContext2d>().ok())
    else {
        return;
    };
    let (w, h) = (canvas.width() as f64, canvas.height() as f64);
    ctx.clear_rect(0.0, 0.0, w, h);
    let hi = losses.iter().copied().fold(f32::MIN, f32::max).max(1e-6) as f64;
    let pad = 20.0;
    ctx.set_stroke_style_str("#888");
    ctx.stroke_rect(pad, pad / 2.0, w - pad * 1.5, h - pad * 1.5);
    if losses.len() < 2 {
        return;
    }
    ctx.set_stroke_style_str("#1f5fbf");
    ctx.set_line_width(1.5);
    ctx.begin_path();
    let n = (losses.len() - 1) as f64;
    for (i, &l) in losses.iter().enumerate() {
        let x = pad + (w - pad * 1.5) * i as f64 / n;
        let y = pad / 2.0 + (h - pad * 1.5) * (1.0 - l as f64 / hi);
        if i == 0 {
            ctx.move_to(x, y);
        } else {
            ctx.line_to(x, y);
        }
    }
    ctx.stroke();
    ctx.set_fill_style_str("#333");
    let _ = ctx.fill_text(&format!("{hi:.3}"), 2.0, pad);
    let _ = ctx.fill_text(&format!("step {}", losses.len()), w - 70.0, h - 4.0);
}
