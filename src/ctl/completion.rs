//! `keelctl completion sh|zsh|fish`: shell completion scripts, written from
//! the command and flag tables of [`super::args`], so a new command or flag
//! completes without anyone editing a script.
//!
//! The sh script is POSIX sh, no arrays and no `[[`: FreeBSD's sh reads it
//! without error (it has no programmable completion, so there it only
//! defines a function), and bash, which does, registers it with `complete`.
//! What completes is static: commands, their second words, resource kinds,
//! output formats, shells and flags; names of jails or contexts would need a
//! request per key press and are left to the user.
//!
//! It never runs anything and never reads a file.

use super::args::{COMMANDS, FLAGS, Shell, verbs};

/// The words `get` and `delete` take first.
const RESOURCES: &[&str] = &[
    "jails",
    "services",
    "nodes",
    "volumes",
    "ingresses",
    "bases",
];

/// The output formats of `-o`.
const FORMATS: &[&str] = &["table", "json", "yaml"];

/// The shells `completion` writes for.
const SHELLS: &[&str] = &["sh", "zsh", "fish"];

/// The script for `shell`.
pub fn script(shell: Shell) -> String {
    match shell {
        Shell::Sh => sh(),
        Shell::Zsh => zsh(),
        Shell::Fish => fish(),
    }
}

/// The second words of `verb`'s forms (`rollout` -> status, history, undo),
/// or the resources for `get` and `delete`.
fn second_words(verb: &str) -> Vec<&'static str> {
    if matches!(verb, "get" | "delete") {
        return RESOURCES.to_vec();
    }
    if verb == "completion" {
        return SHELLS.to_vec();
    }
    let mut words = Vec::new();
    for (form, _) in COMMANDS {
        let mut parts = form.split(' ');
        if parts.next() != Some(verb) {
            continue;
        }
        if let Some(word) = parts.next()
            && !word.starts_with('-')
            && word.chars().all(|c| c.is_ascii_lowercase() || c == '-')
            && !words.contains(&word)
        {
            words.push(word);
        }
    }
    words
}

fn long_flags() -> Vec<String> {
    FLAGS.iter().map(|f| format!("--{}", f.long)).collect()
}

fn sh() -> String {
    let mut cases = String::new();
    for verb in verbs() {
        let words = second_words(verb);
        if !words.is_empty() {
            cases.push_str(&format!(
                "        {verb}) _keelctl_words='{}' ;;\n",
                words.join(" ")
            ));
        }
    }
    format!(
        r#"# keelctl completion for sh. Load it with: . <(keelctl completion sh)
# in bash, or save it and source it from your shell's rc file. It is POSIX
# sh: FreeBSD's sh reads it without error but has no programmable
# completion, so there it only defines the function.
# compgen, complete and read -a are bash's; they run only where bash
# registered the function, so POSIX sh never reaches them:
# shellcheck disable=SC3044,SC3045
_keelctl() {{
    # bash passes the command, the word being completed and the word before.
    _keelctl_words=
    case $3 in
        keelctl) _keelctl_words='{verbs}' ;;
        -o|--output) _keelctl_words='{formats}' ;;
        -f|--filename|--socket|--key-file|-c|--config)
            _keelctl_words=
            ;;
{cases}        *) _keelctl_words='{flags}' ;;
    esac
    case $3 in
        -f|--filename|--socket|--key-file|-c|--config)
            # Paths: the shell's own file completion.
            read -r -a COMPREPLY <<_keelctl_eof
$(compgen -f -- "$2" | tr '\n' ' ')
_keelctl_eof
            ;;
        *)
            read -r -a COMPREPLY <<_keelctl_eof
$(compgen -W "$_keelctl_words" -- "$2" | tr '\n' ' ')
_keelctl_eof
            ;;
    esac
}}
if command -v complete >/dev/null 2>&1; then
    complete -F _keelctl keelctl
fi
"#,
        verbs = verbs().join(" "),
        formats = FORMATS.join(" "),
        flags = long_flags().join(" "),
    )
}

fn zsh() -> String {
    let mut cases = String::new();
    for verb in verbs() {
        let words = second_words(verb);
        if !words.is_empty() {
            cases.push_str(&format!(
                "        {verb}) compadd -- {} ;;\n",
                words.join(" ")
            ));
        }
    }
    format!(
        r#"#compdef keelctl
# keelctl completion for zsh: save as _keelctl in a directory of $fpath, or
# load it with: source <(keelctl completion zsh)
_keelctl() {{
    local previous=${{words[CURRENT-1]}}
    case $previous in
        keelctl) compadd -- {verbs} ;;
        -o|--output) compadd -- {formats} ;;
        -f|--filename|--socket|--key-file|-c|--config) _files ;;
{cases}        *) compadd -- {flags} ;;
    esac
}}
if (( $+functions[compdef] )); then
    compdef _keelctl keelctl
fi
"#,
        verbs = verbs().join(" "),
        formats = FORMATS.join(" "),
        flags = long_flags().join(" "),
    )
}

fn fish() -> String {
    let mut out = String::from(
        "# keelctl completion for fish: save as ~/.config/fish/completions/keelctl.fish\n\
         complete -c keelctl -f\n",
    );
    for (form, help) in COMMANDS {
        let verb = form.split(' ').next().unwrap_or(form);
        // One line per verb: the first form's help describes it.
        if COMMANDS
            .iter()
            .find(|(f, _)| f.split(' ').next() == Some(verb))
            .is_some_and(|(f, _)| f == form)
        {
            out.push_str(&format!(
                "complete -c keelctl -n __fish_use_subcommand -a {verb} -d {}\n",
                fish_quote(help)
            ));
        }
    }
    for verb in verbs() {
        let words = second_words(verb);
        if !words.is_empty() {
            out.push_str(&format!(
                "complete -c keelctl -n '__fish_seen_subcommand_from {verb}' -a '{}'\n",
                words.join(" ")
            ));
        }
    }
    for flag in FLAGS {
        let mut line = format!("complete -c keelctl -l {}", flag.long);
        if let Some(c) = flag.short {
            line.push_str(&format!(" -s {c}"));
        }
        match (flag.long, flag.value) {
            ("output", _) => line.push_str(&format!(" -x -a '{}'", FORMATS.join(" "))),
            ("filename" | "socket" | "key-file" | "config", _) => line.push_str(" -r -F"),
            (_, Some(_)) => line.push_str(" -x"),
            (_, None) => {}
        }
        line.push_str(&format!(" -d {}\n", fish_quote(flag.help)));
        out.push_str(&line);
    }
    out
}

/// `text` in fish's single quotes.
fn fish_quote(text: &str) -> String {
    format!("'{}'", text.replace('\\', "\\\\").replace('\'', "\\'"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_command_and_flag_is_in_every_script() {
        for shell in [Shell::Sh, Shell::Zsh, Shell::Fish] {
            let text = script(shell);
            for verb in verbs() {
                assert!(text.contains(verb), "{shell:?} lacks {verb}");
            }
            for flag in FLAGS {
                assert!(text.contains(flag.long), "{shell:?} lacks --{}", flag.long);
            }
        }
    }

    #[test]
    fn second_words_come_from_the_command_table() {
        assert_eq!(second_words("rollout"), ["status", "history", "undo"]);
        assert_eq!(second_words("get"), RESOURCES);
        assert_eq!(
            second_words("config"),
            [
                "get-contexts",
                "current-context",
                "use-context",
                "set-context",
                "delete-context"
            ]
        );
        assert!(second_words("apply").is_empty(), "-f is a flag, not a word");
    }
}
