//! The admin API of tenants and keys over a [`dsec_iam::Iam`]: a [`Router`] to merge
//! into the server's (it has no fallback of its own).
//!
//! | route | who | does |
//! |---|---|---|
//! | `GET /v1/tenants` | cluster admin | every tenant |
//! | `POST /v1/tenants` | cluster admin | create ([`api::CreateTenant`]) → 201 [`Tenant`] |
//! | `GET /v1/tenants/{t}` | admin of `t` | the tenant |
//! | `PATCH /v1/tenants/{t}` | cluster admin | quotas / disabled ([`api::UpdateTenant`]) |
//! | `GET /v1/tenants/{t}/usage` | admin of `t` | its reserved [`dsec_iam::Usage`] |
//! | `GET /v1/tenants/{t}/keys` | admin of `t` | its keys, without secrets |
//! | `POST /v1/tenants/{t}/keys` | admin of `t` | create ([`api::CreateKey`]) → 201 [`NewKey`] (the secret, once) |
//! | `GET /v1/keys/{id}` | admin of its tenant | the key, without secret |
//! | `DELETE /v1/keys/{id}` | admin of its tenant | revoke now |
//! | `POST /v1/keys/{id}/rotate?grace_s=N` | admin of its tenant | new key; the old one ends after N s |
//!
//! A cluster admin is an `admin` key of tenant `default` (the bootstrap key is one); an
//! "admin of `t`" is a cluster admin or an `admin` key of `t`. A key without the `admin`
//! scope gets `forbidden`; a tenant admin asking about another tenant or its keys gets
//! `not_found`, as if they did not exist.

use std::sync::Arc;

use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use dsec_iam::{api, Iam, IamError, KeyInfo, NewKey, Principal, Scope, Tenant};
use dsec_wire::ErrorCode;

use crate::error::HttpError;
use crate::extract::{api_key, Json, Path, Query};

/// The admin routes over `iam`.
pub fn admin_router(iam: Arc<Iam>) -> Router {
    Router::new()
        .route("/v1/tenants", get(list_tenants).post(create_tenant))
        .route("/v1/tenants/{tenant}", get(get_tenant).patch(update_tenant))
        .route("/v1/tenants/{tenant}/usage", get(usage))
        .route("/v1/tenants/{tenant}/keys", get(list_keys).post(create_key))
        .route("/v1/keys/{key_id}", get(get_key).delete(revoke_key))
        .route("/v1/keys/{key_id}/rotate", post(rotate_key))
        .with_state(iam)
}

fn err(e: IamError) -> HttpError {
    HttpError(e.to_api_error())
}

/// The caller of an admin route: authenticated, with the `admin` scope.
struct Admin(Principal);

impl FromRequestParts<Arc<Iam>> for Admin {
    type Rejection = HttpError;

    async fn from_request_parts(parts: &mut Parts, iam: &Arc<Iam>) -> Result<Self, HttpError> {
        let p = iam
            .authenticate(api_key(&parts.headers).unwrap_or(""))
            .map_err(err)?;
        p.require(Scope::Admin).map_err(err)?;
        Ok(Admin(p))
    }
}

impl Admin {
    fn cluster(&self) -> Result<(), HttpError> {
        if self.0.is_cluster_admin() {
            Ok(())
        } else {
            Err(HttpError::new(
                ErrorCode::Forbidden,
                "only an admin key of the default tenant manages tenants",
            ))
        }
    }

    /// `not_found` (as for a tenant that does not exist) unless it may manage `tenant`.
    fn of(&self, tenant: &str) -> Result<(), HttpError> {
        if self.0.may_manage_keys_of(tenant) {
            Ok(())
        } else {
            Err(err(IamError::UnknownTenant(tenant.into())))
        }
    }
}

fn created<T: serde::Serialize>(v: T) -> Response {
    (StatusCode::CREATED, axum::Json(v)).into_response()
}

async fn list_tenants(
    State(iam): State<Arc<Iam>>,
    admin: Admin,
) -> Result<axum::Json<Vec<Tenant>>, HttpError> {
    admin.cluster()?;
    Ok(axum::Json(iam.list_tenants().await.map_err(err)?))
}

async fn create_tenant(
    State(iam): State<Arc<Iam>>,
    admin: Admin,
    Json(req): Json<api::CreateTenant>,
) -> Result<Response, HttpError> {
    admin.cluster()?;
    let t = iam
        .create_tenant(&req.name, req.quotas)
        .await
        .map_err(err)?;
    Ok(created(t))
}

async fn get_tenant(
    State(iam): State<Arc<Iam>>,
    admin: Admin,
    Path(tenant): Path<String>,
) -> Result<axum::Json<Tenant>, HttpError> {
    admin.of(&tenant)?;
    Ok(axum::Json(iam.get_tenant(&tenant).await.map_err(err)?))
}

async fn update_tenant(
    State(iam): State<Arc<Iam>>,
    admin: Admin,
    Path(tenant): Path<String>,
    Json(req): Json<api::UpdateTenant>,
) -> Result<axum::Json<Tenant>, HttpError> {
    admin.cluster()?;
    Ok(axum::Json(
        iam.update_tenant(&tenant, &req).await.map_err(err)?,
    ))
}

async fn usage(
    State(iam): State<Arc<Iam>>,
    admin: Admin,
    Path(tenant): Path<String>,
) -> Result<axum::Json<dsec_iam::Usage>, HttpError> {
    admin.of(&tenant)?;
    // The tenant must exist (usage of a name never created is not an answer).
    iam.get_tenant(&tenant).await.map_err(err)?;
    Ok(axum::Json(iam.usage(&tenant).await.map_err(err)?))
}

async fn list_keys(
    State(iam): State<Arc<Iam>>,
    admin: Admin,
    Path(tenant): Path<String>,
) -> Result<axum::Json<Vec<KeyInfo>>, HttpError> {
    admin.of(&tenant)?;
    Ok(axum::Json(iam.list_keys(&tenant).await.map_err(err)?))
}

async fn create_key(
    State(iam): State<Arc<Iam>>,
    admin: Admin,
    Path(tenant): Path<String>,
    Json(req): Json<api::CreateKey>,
) -> Result<Response, HttpError> {
    admin.of(&tenant)?;
    let k: NewKey = iam
        .create_key(&tenant, &req.name, &req.scopes, req.expires_at)
        .await
        .map_err(err)?;
    Ok(created(k))
}

/// The key, if `admin` may manage it; `not_found` otherwise, as for an unknown key.
async fn owned_key(iam: &Iam, admin: &Admin, key_id: &str) -> Result<KeyInfo, HttpError> {
    let k = iam.get_key(key_id).await.map_err(err)?;
    if admin.0.may_manage_keys_of(&k.tenant) {
        Ok(k)
    } else {
        Err(err(IamError::UnknownKey(key_id.into())))
    }
}

async fn get_key(
    State(iam): State<Arc<Iam>>,
    admin: Admin,
    Path(key_id): Path<String>,
) -> Result<axum::Json<KeyInfo>, HttpError> {
    Ok(axum::Json(owned_key(&iam, &admin, &key_id).await?))
}

async fn revoke_key(
    State(iam): State<Arc<Iam>>,
    admin: Admin,
    Path(key_id): Path<String>,
) -> Result<axum::Json<KeyInfo>, HttpError> {
    owned_key(&iam, &admin, &key_id).await?;
    Ok(axum::Json(iam.revoke_key(&key_id).await.map_err(err)?))
}

async fn rotate_key(
    State(iam): State<Arc<Iam>>,
    admin: Admin,
    Path(key_id): Path<String>,
    Query(q): Query<api::RotateKey>,
) -> Result<Response, HttpError> {
    owned_key(&iam, &admin, &key_id).await?;
    let grace = std::time::Duration::from_secs(q.grace_s);
    let k = iam.rotate_key(&key_id, grace).await.map_err(err)?;
    Ok(created(k))
}
