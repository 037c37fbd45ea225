//! `leasehold release`: an operator's removal of the rows of an owner that is gone.

use std::io::{BufRead, IsTerminal, Write};

use super::args::Release;
use super::store_failed;
use leasehold::Removal;

/// What removing another owner's rows does and does not protect, said before it is done.
const WHAT_FENCING_DOES: &str = "\
Removing these rows ends their leases now: their waiters are granted at once, as if the owner \
had released. A removed waiting request of an owner still running ends at once, and runs \
nothing. A removed holder still running finds out only at its next heartbeat, and until then it \
goes on as the holder. Fencing tokens protect what checks them: a resource that refuses \
a token lower than the highest it has seen refuses the removed holder's late writes once the \
next holder has written. Anything that does not check the token is not protected.";

pub(crate) fn release(args: Release) -> u8 {
    super::on_existing(&args.store, |locks| async move {
        let entries = match super::show::entries(&locks, None).await {
            Ok(entries) => entries,
            Err(code) => return code,
        };
        // Whose rows, and which: the owner's every request, or the one with the ticket.
        let (owner, ticket) = match (&args.owner, args.key.as_ref().zip(args.ticket)) {
            (Some(owner), _) => (owner.clone(), None),
            (None, Some((key, ticket))) => {
                match entries.iter().find(|e| e.key == *key && e.ticket == ticket) {
                    Some(entry) => (entry.owner.clone(), Some(ticket)),
                    None => {
                        eprintln!(
                            "leasehold: no live row on {key:?} has ticket {ticket}; nothing removed"
                        );
                        return 1;
                    }
                }
            }
            (None, None) => {
                eprintln!("leasehold: say whose rows: --owner, or --key with --ticket");
                return super::USAGE;
            }
        };
        let chosen: Vec<_> = (entries.into_iter())
            .filter(|e| e.owner == owner && ticket.is_none_or(|t| t == e.ticket))
            .collect();
        if chosen.is_empty() {
            eprintln!("leasehold: {owner:?} has no live rows; nothing removed");
            return 1;
        }
        let now = super::show::unix_now();
        // What is about to happen, and the question, where a person sees them however the
        // output is redirected; what was done, on the output.
        eprint!("{}", super::show::table(&chosen, now));
        eprintln!("\n{WHAT_FENCING_DOES}\n");
        if !args.yes && !confirmed(chosen.len()) {
            return 1;
        }
        // The requests shown, and no others (not one the owner made since): each by one of
        // its keys and its ticket, which removes its rows on every key.
        let mut requests: Vec<(u64, String)> = chosen
            .iter()
            .map(|entry| (entry.ticket, entry.key.clone()))
            .collect();
        requests.sort_unstable();
        requests.dedup_by_key(|(ticket, _)| *ticket);
        let mut removed = 0;
        for (ticket, key) in requests {
            match locks.remove(Removal::Request { key, ticket }).await {
                Ok(rows) => removed += rows,
                Err(error) => return store_failed(&error),
            }
        }
        if removed == 0 {
            eprintln!("leasehold: the rows were gone already; nothing removed");
            return 1;
        }
        println!("removed {removed} row(s) of {}", super::printable(&owner));
        0
    })
}

/// Asks on the terminal; false unless the answer is yes, and when there is no terminal to ask.
fn confirmed(rows: usize) -> bool {
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        eprintln!(
            "leasehold: not removing without confirmation: pass --yes (stdin is not a terminal)"
        );
        return false;
    }
    eprint!("Remove {rows} row(s)? [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    if stdin.lock().read_line(&mut answer).is_err() {
        return false;
    }
    let yes = matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes");
    if !yes {
        eprintln!("leasehold: nothing removed");
    }
    yes
}
