//! The PostgreSQL versions this release runs on, and the check `migrate()` and
//! `validate_schema` make before anything else.

use sqlx::{PgConnection, PgPool};

use crate::error::{Error, OutboxSql, Result};
use crate::scope::Scope;
use crate::sql::catalog;
use crate::store::connect::explain;

/// The PostgreSQL major versions this release supports and is tested on, lowest and
/// highest: 14 to 18. [`crate::migrate`] and [`crate::schema::validate_schema`] (and the
/// same methods of [`crate::Outbox`]) refuse a server outside it with
/// [`Error::UnsupportedPostgres`] before they read or change anything else.
pub const SUPPORTED_POSTGRES: (u32, u32) = (14, 18);

/// Reads the server's version and refuses one outside `supported`; returns its major
/// version. One catalog-free read (`current_setting`), no lock.
pub(crate) async fn require(pool: &PgPool, supported: (u32, u32)) -> Result<u32> {
    let row: std::result::Result<(String, String), sqlx::Error> =
        sqlx::query_as(catalog::SERVER_VERSION)
            .fetch_one(pool)
            .await;
    let (version, version_num) = match row {
        Ok(row) => row,
        Err(e) => return Err(explain(pool, Error::from_outbox_statement(e)).await),
    };
    check(&version, &version_num, supported)
}

/// [`require`] on a connection the caller holds, with its statements built for `scope`
/// (unnamed in a transaction-mode pooler's transaction).
pub(crate) async fn require_on(
    scope: Scope,
    db: &mut PgConnection,
    supported: (u32, u32),
) -> Result<u32> {
    let (version, version_num): (String, String) = scope
        .query_as(catalog::SERVER_VERSION)
        .fetch_one(&mut *db)
        .await
        .outbox_sql()?;
    check(&version, &version_num, supported)
}

/// The major version of a `server_version_num` (`140023` is 14.23, `90624` is 9.6.24:
/// the major is the number divided by 10 000 since PostgreSQL 10, and below 10 for every
/// earlier release), refused outside `supported`; a number that does not parse is refused
/// too (the server is no PostgreSQL this release knows).
pub(crate) fn check(version: &str, version_num: &str, supported: (u32, u32)) -> Result<u32> {
    let major = version_num.trim().parse::<u32>().ok().map(|n| n / 10_000);
    match major {
        Some(m) if (supported.0..=supported.1).contains(&m) => Ok(m),
        _ => Err(Error::UnsupportedPostgres {
            version: version.to_owned(),
            major,
            supported,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn major_of(num: &str) -> Result<u32> {
        check("x", num, SUPPORTED_POSTGRES)
    }

    #[test]
    fn every_supported_major_passes_from_its_first_to_a_late_minor() {
        for (num, major) in [
            ("140000", 14),
            ("140023", 14),
            ("150018", 15),
            ("160014", 16),
            ("170010", 17),
            ("180004", 18),
            ("189999", 18),
            (" 180004\n", 18),
        ] {
            assert_eq!(major_of(num).unwrap(), major, "{num:?}");
        }
    }

    #[test]
    fn majors_outside_the_range_are_refused_with_the_version_and_the_range() {
        for (num, major) in [
            ("139999", 13),
            ("130014", 13),
            ("100000", 10),
            ("90624", 9),
            ("190000", 19),
            ("200001", 20),
        ] {
            match check("13.14 (Debian 13.14-1)", num, SUPPORTED_POSTGRES) {
                Err(Error::UnsupportedPostgres {
                    version,
                    major: m,
                    supported,
                }) => {
                    assert_eq!(version, "13.14 (Debian 13.14-1)");
                    assert_eq!(m, Some(major), "{num}");
                    assert_eq!(supported, (14, 18));
                }
                other => panic!("{num}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_version_number_that_does_not_parse_is_refused() {
        for num in ["", "abc", "-140000", "14.5", "99999999999999"] {
            let e = major_of(num).unwrap_err();
            assert!(
                matches!(e, Error::UnsupportedPostgres { major: None, .. }),
                "{num:?}: {e:?}"
            );
        }
    }

    #[test]
    fn the_message_names_the_server_version_and_the_supported_range() {
        let e = check("13.14", "130014", SUPPORTED_POSTGRES).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("PostgreSQL 13.14"), "{msg}");
        assert!(msg.contains("PostgreSQL 14 to 18"), "{msg}");
        assert_eq!(
            format!("{e:?}"),
            format!("UnsupportedPostgres: {msg}"),
            "Debug is the variant and the message"
        );
    }

    #[test]
    fn the_range_bounds_are_inclusive_and_configurable() {
        assert_eq!(check("v", "170000", (17, 17)).unwrap(), 17);
        assert!(check("v", "160000", (17, 17)).is_err());
        assert!(check("v", "180000", (17, 17)).is_err());
    }
}
