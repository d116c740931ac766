//! SigV4 request signing (service `bedrock-agentcore`) with `aws-sigv4`.

use std::time::SystemTime;

use aws_sigv4::http_request::{SignableBody, SignableRequest, SigningSettings, sign};
use aws_sigv4::sign::v4;
use aws_smithy_runtime_api::client::identity::Identity;
use tether::Error;

/// The signing name of both AgentCore planes.
pub const SERVICE: &str = "bedrock-agentcore";

/// AWS credentials. `Debug` shows only the access key id.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AwsCredentials {
    /// The access key id.
    pub access_key_id: String,
    /// The secret access key.
    pub secret_access_key: String,
    /// The session token of temporary credentials.
    pub session_token: Option<String>,
}

impl std::fmt::Debug for AwsCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AwsCredentials")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field(
                "session_token",
                &self.session_token.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

impl AwsCredentials {
    /// Credentials from their parts.
    pub fn new(access_key_id: impl Into<String>, secret: impl Into<String>, token: Option<String>) -> Self {
        AwsCredentials {
            access_key_id: access_key_id.into(),
            secret_access_key: secret.into(),
            session_token: token,
        }
    }

    /// Reads `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and (optional) `AWS_SESSION_TOKEN`.
    pub fn from_env() -> tether::Result<Self> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        match (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY")) {
            (Some(id), Some(secret)) => Ok(AwsCredentials::new(id, secret, var("AWS_SESSION_TOKEN"))),
            _ => Err(Error::Auth(
                "AWS credentials are not set: export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY \
                 (and AWS_SESSION_TOKEN for temporary credentials)"
                    .into(),
            )),
        }
    }
}

/// The region: explicit, else `AWS_REGION`, else `AWS_DEFAULT_REGION`, else `us-east-1`.
pub fn resolve_region(explicit: Option<&str>) -> String {
    explicit
        .map(str::to_owned)
        .or_else(|| std::env::var("AWS_REGION").ok())
        .or_else(|| std::env::var("AWS_DEFAULT_REGION").ok())
        .filter(|r| !r.trim().is_empty())
        .unwrap_or_else(|| "us-east-1".into())
}

/// Signs a request; returns the headers to add (`x-amz-date`, `authorization`, and
/// `x-amz-security-token` for temporary credentials). `url` must already be percent-encoded;
/// `headers` are those sent with the request that should be signed (include `host`).
#[allow(clippy::too_many_arguments)]
pub fn sign_request(
    method: &str,
    url: &str,
    headers: &[(String, String)],
    body: &[u8],
    creds: &AwsCredentials,
    region: &str,
    service: &str,
    time: SystemTime,
) -> tether::Result<Vec<(String, String)>> {
    let identity: Identity = aws_credential_types::Credentials::new(
        creds.access_key_id.clone(),
        creds.secret_access_key.clone(),
        creds.session_token.clone(),
        None,
        "tether",
    )
    .into();
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name(service)
        .time(time)
        .settings(SigningSettings::default())
        .build()
        .map_err(|e| Error::config_with(tether::ConfigKind::Invalid, "SigV4 parameters", e))?
        .into();
    let signable = SignableRequest::new(
        method,
        url,
        headers.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        SignableBody::Bytes(body),
    )
    .map_err(|e| Error::config(tether::ConfigKind::Invalid, format!("cannot sign {url}: {e}")))?;
    let (instructions, _signature) = sign(signable, &params)
        .map_err(|e| Error::config(tether::ConfigKind::Invalid, format!("cannot sign {url}: {e}")))?
        .into_parts();
    Ok(instructions
        .headers()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect())
}
