//! The web UI, embedded in the binary (built from `web/` by `npm run build`; no node at run time).

use axum::extract::Path;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

const INDEX: &[u8] = include_bytes!("../assets/index.html");
const APP_JS: &[u8] = include_bytes!("../assets/app.js");
const APP_CSS: &[u8] = include_bytes!("../assets/app.css");

fn with_type(body: &'static [u8], content_type: &'static str) -> Response {
    let mut r = body.into_response();
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // No framing (another site could overlay the UI and have the user click Approve), no
    // Referer (the token is in the fragment, never sent; this is belt and braces), no sniffing.
    r.headers_mut().insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'",
        ),
    );
    r.headers_mut()
        .insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    r.headers_mut()
        .insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    r.headers_mut().insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    r
}

pub(crate) async fn index() -> Response {
    with_type(INDEX, "text/html; charset=utf-8")
}

pub(crate) async fn asset(Path(file): Path<String>) -> Response {
    match file.as_str() {
        "app.js" => with_type(APP_JS, "text/javascript; charset=utf-8"),
        "app.css" => with_type(APP_CSS, "text/css; charset=utf-8"),
        _ => (StatusCode::NOT_FOUND, "no such asset").into_response(),
    }
}
