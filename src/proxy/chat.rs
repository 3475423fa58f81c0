//! `POST /v1/chat/completions`: the hook where compaction plugs in.
//!
//! For now it forwards like every other request. Later issues read the body
//! (bounded: the body is already limited, see [`super::body_read_error`]),
//! decide about compaction, and use [`super::send_upstream`] and
//! [`super::stream_response`] to talk to the upstream and stream back.

use std::sync::Arc;

use http::{Request, Response};

use crate::app::AppState;
use crate::error::ProxyBody;
use crate::proxy::body::ProxyReqBody;

/// Handles one chat completion request.
pub async fn handle(state: Arc<AppState>, req: Request<ProxyReqBody>) -> Response<ProxyBody> {
    super::forward(&state, req).await
}
