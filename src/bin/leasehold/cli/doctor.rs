//! `leasehold doctor`: what is wrong with a store, and what to do about it, as the library's
//! checks find it (`LockManagerBuilder::check`, `check_server`). Every check reads; nothing is
//! changed, and a store that is not there is not made.

use super::args::Doctor;
use super::{printable, store_failed, Store};
use leasehold::LockManager;

pub(crate) fn doctor(args: Doctor) -> u8 {
    let store = match args.store.parse() {
        Ok(store) => store,
        Err(code) => return code,
    };
    let checked = match &store {
        Store::File(path) => LockManager::builder().check(path),
        #[cfg(feature = "postgres")]
        Store::Postgres { url, schema } => {
            smol::block_on(Store::schema(LockManager::builder(), schema).check_server(url))
        }
    };
    let findings = match checked {
        Ok(findings) => findings,
        Err(error) => return store_failed(&error),
    };
    for finding in &findings {
        // Paths, schemas and owners come from the store and the arguments: one of them cannot
        // break a line or move the cursor.
        println!("{}", printable(&finding.to_string()));
    }
    match findings.iter().filter(|finding| finding.problem).count() {
        0 => {
            println!("nothing is wrong");
            0
        }
        n => {
            println!("{n} problem(s) found");
            1
        }
    }
}
